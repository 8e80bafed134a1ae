"""``cuboid convert``: sharded <-> single-file safetensors folders, dtype casts, verification.

    cuboid convert SRC DST                       one model.safetensors
    cuboid convert SRC DST --max-shard-size 2GB  HF-style shards + index
    cuboid convert SRC DST --dtype bf16          cast floating-point tensors
    cuboid convert --verify PATH                 check sizes and SHA-256s
    cuboid convert ADAPTERS DST --merge-lora     a LoRA adapter folder folded into its base
                                                 (--base FOLDER, else the adapter config's)

Streams tensor by tensor (peak: one tensor and its cast copy), with a progress
bar. Errors are one line on stderr and exit code 2. --overwrite replaces DST
only when it holds nothing but model files or is a folder cuboid wrote; a
companion file (tokenizer, card) that is a link out of SRC is skipped with a
warning line.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from contextlib import contextmanager
from typing import Optional, Sequence


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``convert`` on an ``add_subparsers()`` object; the handler is ``args.func``."""
    p = subparsers.add_parser(
        "convert", help="convert a safetensors checkpoint folder (shards, single file, dtype) or verify one",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n\n")[1:2]))
    p.add_argument("src", nargs="?", metavar="SRC", help="checkpoint folder to read")
    p.add_argument("dst", nargs="?", metavar="DST", help="folder to write (must not exist unless --overwrite)")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help='write shards of at most SIZE (HF units: "5GB" = 5e9 bytes); default: one file')
    p.add_argument("--dtype", metavar="DTYPE", help="cast floating-point tensors: fp32, fp16, bf16")
    p.add_argument("--verify", metavar="PATH", help="verify PATH (sizes, SHA-256s, structure) and exit")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it is a checkpoint folder")
    p.add_argument("--merge-lora", action="store_true",
                   help="SRC is a LoRA adapter folder (peft layout): write its base model with the adapters "
                        "merged into the weights, as a Hugging Face folder")
    p.add_argument("--base", metavar="FOLDER",
                   help="with --merge-lora: the base model folder, or a hub id org/name from the Hugging Face "
                        "cache (default: the adapter config's base_model_name_or_path)")
    p.add_argument("--quantize", metavar="nf4",
                   help="with --merge-lora: the adapters were trained on a 4-bit NF4 base (QLoRA): merge them into "
                        "the base dequantized from NF4, as peft's merge_and_unload does (a base folder saved in 4 "
                        "bits, and adapters that record their NF4 base, as a QLoRA fine-tune's do, are recognised "
                        "without it)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _fail(msg: str) -> int:
    print(f"cuboid convert: error: {' '.join(str(msg).split())}", file=sys.stderr)
    return 2


@contextmanager
def _warning_lines():
    """Warnings raised inside (a skipped companion link) printed as one ``cuboid convert: warning:`` line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in caught:
                print(f"cuboid convert: warning: {' '.join(str(w.message).split())}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from cuboid.zoo import checkpoint

    if args.verify is not None:
        if args.src or args.dst or args.max_shard_size or args.dtype:
            return _fail("--verify PATH takes no SRC, DST, --max-shard-size or --dtype")
        try:
            r = checkpoint.verify(args.verify)
        except (ValueError, OSError) as e:
            return _fail(e)
        print(f"ok: {r['path']}: {r['files']} files, {r['tensors']} tensors, {r['bytes']} bytes verified")
        return 0
    if not args.src or not args.dst:
        return _fail("convert needs SRC and DST (or --verify PATH)")
    if args.merge_lora:
        return _merge(args)
    if args.base:
        return _fail("--base goes with --merge-lora")
    if args.quantize:
        return _fail("--quantize goes with --merge-lora (the base of a QLoRA run)")
    size = args.max_shard_size
    if size is not None and size.isdigit():
        size = int(size)
    try:
        with _warning_lines():
            out = checkpoint.convert(args.src, args.dst, max_shard_size=size, dtype=args.dtype,
                                     progress=not args.quiet, overwrite=args.overwrite)
    except (ValueError, OSError) as e:
        return _fail(e)
    print(f"wrote {out}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    """``--merge-lora``: the base with the adapters folded in, with the tokenizer and generation config of the
    adapter folder or else the base (what ``cuboid generate`` needs), then (for shards or a dtype) converted."""
    from pathlib import Path

    dst = Path(args.dst)
    if dst.exists() and any(dst.iterdir()) and not args.overwrite:
        return _fail(f"{dst} exists and is not empty (--overwrite replaces it)")
    try:
        with _warning_lines():
            out = _merge_into(args, dst)
    except (ValueError, OSError, KeyError) as e:
        return _fail(e)
    print(f"wrote {out}")
    return 0


def _is_4bit(folder) -> bool:
    from cuboid.loading.quantize import folder_is_4bit

    return folder_is_4bit(folder)


def _trained_on_nf4(adapters) -> bool:
    """Whether the adapter folder records that its base was NF4-quantized (a QLoRA run's; its
    ``base_quantization_config.json``): then the merge goes into that base dequantized, which is what the
    adapters were trained against (peft's ``merge_and_unload`` on the 4-bit model), said in one line."""
    from cuboid.zoo.checkpoint.adapters import BASE_QUANTIZATION, recorded_quantization

    if recorded_quantization(adapters) is None:
        return False
    print(f"cuboid convert: {adapters} was trained on an NF4-quantized base ({BASE_QUANTIZATION}): merging into "
          f"that base dequantized from NF4, as peft's merge_and_unload does on the 4-bit model", file=sys.stderr)
    return True


def merge_qlora(adapters, out, *, base, dtype=None):
    """A QLoRA run's adapters folded into its base dequantized from NF4 (as peft's ``merge_and_unload`` on a
    bitsandbytes base): ``W = dequantize(W4) + s B A`` in fp32, written to ``out`` as a Hugging Face folder in
    ``dtype`` (default bf16). ``base``: the bf16 folder the run quantized, or a 4-bit folder. One process."""
    import torch

    from cuboid.loading.model import load
    from cuboid.parallel.lora import merge_adapters
    from cuboid.parallel.quant import quantized_layers
    from cuboid.zoo import to_hf

    model = load(base, quantize="nf4", lora=adapters, dtype=torch.float32)
    merge_adapters(model)
    if quantized_layers(model):
        raise ValueError(f"{adapters}: the adapters cover only some of the 4-bit linears; a merged folder needs "
                         f"them all dequantized")
    model.to(torch.bfloat16 if dtype is None else dtype)
    for p in model.parameters():
        p.requires_grad_(True)
    return to_hf(model, out)


def _merge_into(args: argparse.Namespace, dst) -> str:
    import os
    import tempfile

    from cuboid.zoo import checkpoint
    from cuboid.zoo.checkpoint.convert import copy_companions
    from cuboid.zoo.lora import merge_to_hf, read_config

    from cuboid.loading.hub import locate

    # the base: --base or the adapter config's, a hub id read from the Hugging Face cache (cuboid.loading.hub)
    base = locate(args.base or read_config(args.src)[2].get("base_model_name_or_path"))
    merge = merge_to_hf
    quantize = getattr(args, "quantize", None)
    if quantize is None and _trained_on_nf4(args.src):
        quantize = "nf4"
    if quantize is not None or (base and os.path.isdir(base) and _is_4bit(base)):
        from cuboid.parallel.quant import check_quantize

        check_quantize(quantize or "nf4")

        def merge(src, out, base=None):  # a QLoRA run's merge: the base dequantized from NF4
            return merge_qlora(src, out, base=base or read_config(src)[2].get("base_model_name_or_path"))
    if args.max_shard_size is None and args.dtype is None:
        out = merge(args.src, dst, base=base)
        copy_companions(out, args.src, base)
        return os.fspath(out)
    with tempfile.TemporaryDirectory(prefix=".cuboid-merge-", dir=dst.parent if dst.parent.exists() else None) as tmp:
        copy_companions(merge(args.src, tmp, base=base), args.src, base)
        size = args.max_shard_size
        size = int(size) if size is not None and size.isdigit() else size
        return os.fspath(checkpoint.convert(tmp, dst, max_shard_size=size, dtype=args.dtype,
                                            progress=not args.quiet, overwrite=args.overwrite))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``cuboid convert ...`` on its own (tests, scripts): ``main(["convert", SRC, DST])``."""
    parser = argparse.ArgumentParser(prog="cuboid")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
