"""The `lazyckpt` command line: inspect, show, stats, diff, convert, demo."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

# The standard library and lazyckpt's own errors, sizes and text only: see main.
from lazyckpt import __version__
from lazyckpt import _sizes as sizes
from lazyckpt._errors import LazyckptError, SizeError
from lazyckpt._text import ascii_int

_PATH = (
    "an Orbax checkpoint folder, step folder or manager root; a safetensors file or "
    "model folder; a PyTorch (.bin, .pt, .pth), NumPy (.npz, .npy) or flax msgpack "
    "file or model folder. Local, s3://, gs://, hf://ORG/NAME[@REV][/PATH] or https://"
)

_TRACEBACK = "show tracebacks of errors"


def parse_size(text: str) -> int:
    """Bytes from a SIZE flag, as the API reads sizes (`lazyckpt._sizes`); a bad one
    is argparse's usage error, which names the flag.

    >>> parse_size("256MiB"), parse_size("5GB"), parse_size("4096")
    (268435456, 5000000000, 4096)
    """
    try:
        return sizes.parse_size(text)
    except SizeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    """A count flag (`--bins`, `--depth`): a whole number of 1 or more, else argparse's
    usage error, which names the flag.

    >>> positive_int("8")
    8
    """
    number = ascii_int(text)
    if number is None or number < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a whole number of 1 or more")
    return number


def metadata_item(text: str) -> tuple[str, str]:
    """A `--metadata KEY=VALUE` flag as its pair; without `=`, argparse's usage error.

    >>> metadata_item("step=1000")
    ('step', '1000')
    """
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: pass KEY=VALUE, such as step=1000")
    return key, value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazyckpt", description="Open JAX checkpoints lazily; read only what you ask for."
    )
    parser.add_argument("--traceback", action="store_true", help=_TRACEBACK)
    parser.add_argument("--version", action="version", version=f"lazyckpt {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str, *, source: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=summary)
        # After the verb too (`lazyckpt convert ... --traceback`); SUPPRESS keeps the
        # one given before the verb when this one is not.
        sub.add_argument(
            "--traceback", action="store_true", default=argparse.SUPPRESS, help=_TRACEBACK
        )
        if source:
            sub.add_argument("path", help=_PATH)
            sub.add_argument("--step", type=int, help="step of a CheckpointManager root")
            sub.add_argument("--item", help="item of a step folder (state, params, ...)")
        return sub

    def selecting(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--select",
            action="append",
            metavar="PATTERN",
            help="only leaves matching PATTERN ('params/**/kernel'), less those matching a "
            "'!PATTERN' ('!opt_state/**'); repeat for several",
        )

    def budget(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--memory-budget",
            type=parse_size,
            metavar="SIZE",
            help="bytes in flight: 256MiB, 1GB (10^9) or bytes",
        )

    def expanding(sub: argparse.ArgumentParser, what: str) -> None:
        sub.add_argument("--expand", action="store_true", help=what)

    def dequantizing(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--dequantize",
            action="store_true",
            help="show FP8 block-scaled (X.weight_scale_inv) and MXFP4 (X_blocks, X_scales) "
            "weights as their dense bfloat16 values",
        )

    inspect = command("inspect", "the tree: shapes, dtypes, sizes, saved shardings; reads no data")
    selecting(inspect)
    dequantizing(inspect)
    inspect.add_argument(
        "--depth", type=positive_int, metavar="N", help="show N levels of the tree (1 or more)"
    )
    expanding(
        inspect,
        "a row for every subtree and leaf: numbered siblings alike (layers/{3..60}/) and "
        "subtrees equal to one above are not folded",
    )
    inspect.add_argument("--json", action="store_true", help="print JSON for scripts (every leaf)")

    show = command("show", "print a few values: lazyckpt show PATH 'params/embed[0:3, :8]'")
    dequantizing(show)
    show.add_argument(
        "key",
        help="key path, with an optional NumPy-style index: ints, slices, ..., None, and "
        "lists of ints that pick rows ('embed[[3, 17, 42], :8]')",
    )

    stats = command("stats", "min, max, mean, std, NaN and Inf counts, read chunk by chunk")
    selecting(stats)
    dequantizing(stats)
    budget(stats)
    stats.add_argument(
        "--bins", type=positive_int, metavar="N", help="also a histogram with N bins (1 or more)"
    )
    expanding(stats, "a line per array: equal rows alike but for a layer number are not folded")
    stats.add_argument("--json", action="store_true", help="print JSON for scripts")
    stats.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the figure into FILE (.png, .svg, .pdf): per-layer curves, or the "
        "histograms with --bins (needs lazyckpt[notebook])",
    )

    verify = command("verify", "decode every chunk within the budget; report damage by key path")
    selecting(verify)
    budget(verify)
    verify.add_argument("--json", action="store_true", help="print JSON for scripts")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")

    diff = command(
        "diff", "compare two checkpoints: structure, shapes, dtypes, values", source=False
    )
    diff.add_argument("first", help=f"checkpoint A: {_PATH}")
    diff.add_argument("second", help=f"checkpoint B: {_PATH}")
    diff.add_argument("--step", type=int, nargs=2, metavar=("A", "B"), help="steps of roots")
    diff.add_argument("--item", help="item of the step folders (state, params, ...)")
    selecting(diff)
    budget(diff)
    diff.add_argument("--values", action="store_true", help="compare values too (reads data)")
    expanding(diff, "a line per change: changes alike but for a layer number are not folded")
    diff.add_argument("--json", action="store_true", help="print JSON for scripts")
    diff.add_argument("--exit-code", action="store_true", help="exit with 1 if they differ")
    diff.add_argument(
        "--plot",
        metavar="FILE",
        help="with --values, also draw the arrays that changed most into FILE (.png, .svg)",
    )

    convert = command(
        "convert",
        "rewrite a checkpoint as Orbax or safetensors: keep leaves, rename, cast, re-chunk; "
        "streamed",
    )
    convert.add_argument(
        "destination",
        help="where to write: an Orbax checkpoint folder, or a safetensors model folder "
        "(--to safetensors) or .safetensors file. Local, s3:// or gs:// (hf:// and https:// "
        "are read only)",
    )
    convert.add_argument(
        "--to", choices=("orbax", "safetensors"), help="format (default: from DESTINATION)"
    )
    selecting(convert)
    budget(convert)
    convert.add_argument("--dtype", help="cast floating-point arrays to this dtype (bfloat16)")
    convert.add_argument(
        "--dequantize",
        action="store_true",
        help="replace FP8 block-scaled (X.weight_scale_inv) and MXFP4 (X_blocks, X_scales) "
        "weights by their dense values, in --dtype (default bfloat16); before --select",
    )
    convert.add_argument(
        "--rename",
        nargs=2,
        action="append",
        default=[],
        metavar=("PATTERN", "REPLACEMENT"),
        help="rename key paths by a regular expression ('^params/' 'model/'); repeatable",
    )
    convert.add_argument(
        "--rename-file",
        metavar="FILE",
        help="rename rules, one 'PATTERN REPLACEMENT' per line ('#' comments)",
    )
    convert.add_argument(
        "--rename-dotted",
        action="store_true",
        help="the rename rules see every key path in the Hugging Face spelling, with '.' "
        "between keys (model.layers.0.mlp)",
    )
    convert.add_argument(
        "--rename-missing-ok",
        action="store_true",
        help="let a rename rule that matches no key path pass (by default it is refused)",
    )
    convert.add_argument(
        "--unstack",
        action="append",
        default=[],
        metavar="KEY",
        help="split the scanned arrays under KEY into KEY/{i}/... per layer; repeatable",
    )
    convert.add_argument(
        "--stack",
        action="append",
        default=[],
        metavar="KEY",
        help="stack KEY/{i}/... per-layer arrays into KEY/...; repeatable",
    )
    convert.add_argument(
        "--script",
        metavar="FILE.py",
        help="a Python file defining convert(tree) -> tree, run on the lazy tree (after "
        "--unstack/--stack, before --rename)",
    )
    convert.add_argument(
        "--max-shard-size",
        type=parse_size,
        metavar="SIZE",
        help="safetensors: most bytes of tensors per file (default 5GB: 5 x 10^9 bytes)",
    )
    convert.add_argument(
        "--chunk-bytes",
        type=parse_size,
        metavar="SIZE",
        help="bytes per stored chunk (default 4MiB, as lazyckpt.save)",
    )
    convert.add_argument(
        "--metadata",
        type=metadata_item,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="safetensors: text for the files' metadata, beside format=pt unless it sets "
        "format (a train state's "
        "step=1000, which safetensors cannot hold as a tensor); repeatable",
    )
    convert.add_argument("--overwrite", action="store_true", help="replace DESTINATION")
    convert.add_argument(
        "--allow-expand",
        action="store_true",
        help="write broadcast views (tensors saved expanded, strides 0) whole; without it, "
        "one (or all together) that would write over 1GiB and 1024 times what it stores is refused",
    )
    convert.add_argument(
        "--dry-run",
        action="store_true",
        help="print the names, shapes, dtypes, files or chunks and bytes it would write, "
        "the files it would carry, and whether DESTINATION exists; read no array data, "
        "write nothing",
    )
    convert.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        metavar="N",
        help="start N local processes that divide the work (a jax.distributed job on "
        "127.0.0.1); each holds its own --memory-budget (default 1: this process)",
    )
    convert.add_argument("--quiet", action="store_true", help="no progress bar")

    demo = command(
        "demo", "write a small sharded checkpoint and walk through lazyckpt on it", source=False
    )
    demo.add_argument(
        "--keep",
        metavar="DIR",
        help="a local folder to write the demo's Orbax checkpoint to, and keep",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The commands import lazyckpt's verbs, and with them tensorstore (a second; some
    # commands jax too): only now that there is work, so that --help and argument
    # errors answer at once.
    from lazyckpt._cli import commands

    try:
        with warnings.catch_warnings():
            # One plain line per warning, as errors are: not Python's source-line form.
            warnings.showwarning = commands.show_warning
            return commands.RUN[args.command](args) or 0
    except BrokenPipeError:  # `lazyckpt inspect ... | head`
        return 0
    except Exception as error:
        if args.traceback:
            raise
        message = (
            str(error) if isinstance(error, LazyckptError) else f"{type(error).__name__}: {error}"
        )
        commands.say_message(f"lazyckpt: error: {message}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
