"""The memguard image as built by scripts/build-image.sh: what it ships, as whom, and its size.

Each binary runs from the image as uid 65532 with a read-only root filesystem and no
capabilities, as the chart and the webhook run them.
"""

from __future__ import annotations

import json

import pytest

from harness import CI, IMAGE, ensure_image, missing_runtime, podman, run

#: The distroless/cc base is ~18 MiB, the three stripped binaries ~20 MiB.
MAX_IMAGE_MIB = 64


@pytest.fixture(scope="module")
def image() -> str:
    why = missing_runtime()
    if why:
        if CI:
            pytest.fail(f"image tests cannot run under CI=true: {why}")
        pytest.skip(why)
    ensure_image()
    return IMAGE


def run_in_image(image: str, binary: str, *args: str):
    return podman(
        "run", "--rm", "--read-only", "--user", "65532:65532", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--network", "none",
        "--entrypoint", f"/usr/local/bin/{binary}", image, *args,
        check=False,
    )


@pytest.mark.parametrize(
    "binary,expect",
    [
        ("memguard", "memguard"),
        ("memguard-webhook", "memguard-webhook"),
        ("memguard-sidecar", "memguard-sidecar"),
    ],
)
def test_each_binary_runs_as_65532_on_a_read_only_root(image, binary, expect):
    out = run_in_image(image, binary, "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(expect), out.stdout


def test_the_cli_estimates_from_the_image(image):
    out = run_in_image(
        image, "memguard", "estimate", "--model", "llama-3-8b", "--batch-size", "1",
        "--seq-length", "2048", "--precision", "bf16", "--optimizer", "adamw",
    )
    assert out.returncode == 0, out.stderr
    assert "GiB" in out.stdout, out.stdout


def test_the_image_is_non_root_small_and_runs_the_cli_by_default(image):
    config = json.loads(podman("image", "inspect", image).stdout)[0]
    assert config["Config"]["User"] == "65532:65532"
    assert config["Config"]["Entrypoint"] == ["/usr/local/bin/memguard"]
    size_mib = config["Size"] / (1 << 20)
    print(f"image {image}: {size_mib:.1f} MiB")
    assert size_mib < MAX_IMAGE_MIB, size_mib
    files = run("podman", "run", "--rm", "--entrypoint", "/usr/local/bin/memguard", image, "--help")
    assert files.returncode == 0


def test_the_image_writes_the_python_client_with_no_shell(image, tmp_path):
    """The webhook's `memguard-client` init container: the binary alone writes the client it
    embeds into a volume, as 65532 on a read-only root; the host's Python then imports it."""
    out_dir = tmp_path / "client"
    out_dir.mkdir()
    out_dir.chmod(0o777)  # an emptyDir is world-writable
    out = podman(
        "run", "--rm", "--read-only", "--user", "65532:65532", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--network", "none",
        "-v", f"{out_dir}:/var/run/memguard-client", image,
        "client", "install", "/var/run/memguard-client",
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert (out_dir / "sitecustomize.py").is_file()
    probe = run("python3", "-c", "import memguard_client.auto as a; print(a.__file__)",
                env={"PYTHONPATH": str(out_dir), "PATH": "/usr/bin:/bin"})
    assert probe.stdout.strip() == str(out_dir / "memguard_client" / "auto.py"), probe
