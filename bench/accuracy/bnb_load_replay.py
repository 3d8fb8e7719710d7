#!/usr/bin/env python3
"""How much of the caching allocator's reserve a bitsandbytes 4-bit load leaves unused.

A lead for ms-swift's bnb NF4 rows (set 2, H2-037/040/043: 5.3, 6.9 and 16.6 GB over the
estimate, measured as `torch.cuda.max_memory_reserved` over the whole process, load included).
bitsandbytes 0.39-0.41.3 quantizes at load on the device, one matrix at a time:
`Params4bit.cuda` copies the weight to the GPU in fp16 (`self.data.contiguous().half().cuda()`),
`quantize_4bit` allocates the fp32 `absmax` and the packed `out`, double quantization allocates
`code`, `absmax2`, the uint8 `qabsmax` and the offset and frees `absmax`, and the fp16 copy is
freed when `cuda` returns. Transient weight-sized blocks interleaved with persistent smaller
ones could pin segments of the reserve.

This is a REPLAY, not a measurement: the allocation sizes of that sequence, in the checkpoint's
order (safetensors sorts names: h.0, h.1, h.10, ...), through a simplified model of PyTorch 2.1's
CUDA caching allocator (requests rounded to 512 B; at most 1 MiB from 2 MiB small segments, under
10 MiB from 20 MiB segments, larger ones rounded up to 2 MiB; best fit; a large block split when
more than 1 MiB remains; merged with free neighbours on free; no release, as on an 80 GB card
that never runs out). It prints, after the load, what is allocated, what is reserved and what is
reserved but free. A GPU run (`torch.cuda.memory_reserved()` after `from_pretrained`) settles it.

`--step` replays, through the same model, one checkpointed training step at 2,048 tokens (the
forward under `no_grad` keeping only each block's input, the fp32 logits and their gradient,
then per block, last first, the recompute keeping its saved tensors and the backward), with 0,
1 or 2 weight-sized 16-bit copies per quantized matmul in forward and backward: 2 is bitsandbytes
0.41.3 computing in bf16 from an fp16 quantization state (`dequantize_4bit(B).to(A.dtype)`), 1 a
kernel that dequantizes once in the compute dtype. The block's tensor list is an approximation
of Qwen-1's (fused qkv, SwiGLU MLP); it prints the reserve of each variant, for the difference
between them.

Rerun: `python3 bench/accuracy/bnb_load_replay.py [--step]` (standard library only, seconds).
"""

from __future__ import annotations

import sys

MIB = 1 << 20

# name: (hidden, layers, per-branch intermediate, vocabulary); Qwen-1 fuses q,k,v into c_attn and
# has its MLP as w1, w2 (h x ff each) and c_proj (ff x h); LLaMA-13B is laid out the same way.
MODELS = {
    "qwen-7b (H2-037)": (4096, 32, 11008, 151936),
    "qwen-14b (H2-040)": (5120, 40, 13696, 152064),
    "qwen-72b (H2-043)": (8192, 80, 24576, 152064),
    "llama-13b (H2-098)": (5120, 40, 13824, 32000),
}


class Segment:
    def __init__(self, size: int, small: bool):
        self.small = small
        self.blocks = [[0, size, False]]  # offset, size, in use


class CachingAllocator:
    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.reserved = 0
        self.allocated = 0

    def malloc(self, size: int) -> tuple[Segment, int]:
        size = max(512, -(-size // 512) * 512)
        small = size <= MIB
        best = None
        for seg in self.segments:
            if seg.small != small:
                continue
            for block in seg.blocks:
                if not block[2] and block[1] >= size and (best is None or block[1] < best[1][1]):
                    best = (seg, block)
        if best is None:
            if small:
                seg_size = 2 * MIB
            elif size < 10 * MIB:
                seg_size = 20 * MIB
            else:
                seg_size = -(-size // (2 * MIB)) * 2 * MIB
            seg = Segment(seg_size, small)
            self.segments.append(seg)
            self.reserved += seg_size
            best = (seg, seg.blocks[0])
        seg, block = best
        index = seg.blocks.index(block)
        remaining = block[1] - size
        if remaining > (0 if small else MIB) and remaining >= 512:
            seg.blocks[index : index + 1] = [[block[0], size, True], [block[0] + size, remaining, False]]
        else:
            block[2] = True
        self.allocated += seg.blocks[index][1]
        return seg, seg.blocks[index][0]

    def free(self, handle: tuple[Segment, int]) -> None:
        seg, offset = handle
        index = next(i for i, b in enumerate(seg.blocks) if b[0] == offset)
        block = seg.blocks[index]
        block[2] = False
        self.allocated -= block[1]
        if index + 1 < len(seg.blocks) and not seg.blocks[index + 1][2]:
            block[1] += seg.blocks[index + 1][1]
            del seg.blocks[index + 1]
        if index > 0 and not seg.blocks[index - 1][2]:
            seg.blocks[index - 1][1] += block[1]
            del seg.blocks[index]


def quantize_on_device(alloc: CachingAllocator, numel: int) -> None:
    """`Params4bit.cuda` + `quantize_4bit(compress_statistics=True)`, bitsandbytes 0.41.3."""
    weight_fp16 = alloc.malloc(2 * numel)
    blocks = -(-numel // 64)
    absmax = alloc.malloc(4 * blocks)
    alloc.malloc(-(-numel // 2))  # packed NF4 weight, kept
    alloc.malloc(256 * 4)  # code, kept
    alloc.malloc(4 * -(-blocks // 256))  # absmax2, kept
    alloc.malloc(blocks)  # qabsmax, kept
    alloc.malloc(4)  # offset, kept
    alloc.free(absmax)
    alloc.free(weight_fp16)


def replay(hidden: int, layers: int, ff: int, vocab: int) -> CachingAllocator:
    alloc = CachingAllocator()
    matrices = [3 * hidden * hidden, hidden * hidden, ff * hidden, hidden * ff, hidden * ff]
    alloc.malloc(vocab * hidden * 2)  # embeddings, fp16, kept
    for _ in sorted(range(layers), key=str):
        alloc.malloc(3 * hidden * 2)  # c_attn bias
        for numel in matrices:
            quantize_on_device(alloc, numel)
        alloc.malloc(hidden * 2)  # ln_1
        alloc.malloc(hidden * 2)  # ln_2
    alloc.malloc(hidden * 2)  # ln_f
    alloc.malloc(vocab * hidden * 2)  # lm_head, fp16, kept
    return alloc


def replay_step(hidden: int, layers: int, ff: int, vocab: int, tokens: int, copies: int) -> int:
    """Reserve after load and one checkpointed step, `copies` weight-sized copies per matmul."""
    alloc = replay(hidden, layers, ff, vocab)
    h, s = hidden, tokens
    matmuls = [(3 * h * h, s * 3 * h), (h * h, s * h), (h * ff, s * ff), (h * ff, s * ff), (ff * h, s * h)]

    def quantized_matmul(weight_numel: int, out_numel: int) -> tuple[Segment, int]:
        weights = [alloc.malloc(2 * weight_numel) for _ in range(copies)]
        out = alloc.malloc(2 * out_numel)
        for weight in weights:
            alloc.free(weight)
        return out

    def block(keep: bool) -> tuple[tuple[Segment, int], list]:
        kept = []
        norm = alloc.malloc(2 * s * h)
        for index, (weight_numel, out_numel) in enumerate(matmuls):
            out = quantized_matmul(weight_numel, out_numel)
            (kept.append if keep else alloc.free)(norm)
            norm = out if index != 1 else alloc.malloc(2 * s * h)  # residual + second norm
            if index == 1:
                (kept.append if keep else alloc.free)(out)
        output = alloc.malloc(2 * s * h)
        (kept.append if keep else alloc.free)(norm)
        return output, kept

    inputs = [alloc.malloc(2 * s * h)]
    for _ in range(layers):
        output, _ = block(keep=False)
        inputs.append(output)
    logits = alloc.malloc(4 * s * vocab)
    logits_grad = alloc.malloc(4 * s * vocab)
    alloc.free(logits)
    grad = alloc.malloc(2 * s * h)
    alloc.free(logits_grad)
    alloc.free(inputs.pop())
    for _ in range(layers):
        output, kept = block(keep=True)
        alloc.free(output)
        for weight_numel, out_numel in reversed(matmuls):
            alloc.free(quantized_matmul(weight_numel, max(out_numel, s * h)))
        for tensor in kept:
            alloc.free(tensor)
        new_grad = alloc.malloc(2 * s * h)
        alloc.free(grad)
        grad = new_grad
        alloc.free(inputs.pop())
    return alloc.reserved


def main() -> None:
    if "--step" in sys.argv[1:]:
        for name, (hidden, layers, ff, vocab) in MODELS.items():
            reserves = [replay_step(hidden, layers, ff, vocab, 2048, copies) / 1e9 for copies in (0, 1, 2)]
            print(
                f"{name}: reserved after one step, 0/1/2 weight copies per matmul:"
                f" {reserves[0]:.2f} / {reserves[1]:.2f} / {reserves[2]:.2f} GB"
                f" (2 - 1: {reserves[2] - reserves[1]:+.2f} GB)"
            )
        return
    for name, (hidden, layers, ff, vocab) in MODELS.items():
        alloc = replay(hidden, layers, ff, vocab)
        unused = alloc.reserved - alloc.allocated
        print(
            f"{name}: allocated {alloc.allocated / 1e9:.2f} GB, reserved {alloc.reserved / 1e9:.2f} GB,"
            f" reserved but free {unused / 1e9:.2f} GB ({unused / layers / 1e6:.0f} MB per layer)"
        )


if __name__ == "__main__":
    main()
