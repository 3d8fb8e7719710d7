"""memguard's start-up hook, written into the pod by ``memguard client install`` (the webhook's
init container) and found first on ``PYTHONPATH``.

It installs :mod:`memguard_client.auto` (attach to a ``transformers.Trainer`` when the script
imports transformers; record an uncaught OOM) and then runs the ``sitecustomize`` this file
shadows, if the image or the user has one. Any failure is one line on stderr, and the trainer
runs as if memguard were absent.
"""


def _memguard_start() -> None:
    import sys

    try:
        from memguard_client import auto

        auto.install()
    except Exception as exc:  # noqa: BLE001 - a broken client must never stop the trainer
        sys.stderr.write(
            f"memguard: the injected client is off, training goes on without it "
            f"({type(exc).__name__}: {exc})\n"
        )


def _chain_shadowed() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (this file shadows it)."""
    import os
    import sys
    from importlib.machinery import PathFinder

    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    import importlib.util

    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - as Python's own site.py does: report, go on
        sys.stderr.write(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:\n"
                         f"{type(exc).__name__}: {exc}\n")


_memguard_start()
_chain_shadowed()
