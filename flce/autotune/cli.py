"""``flce-autotune`` (also ``python -m flce.autotune``): tune, show and clear the autotune cache.

    flce-autotune tune --device cuda --dtype bfloat16 --hidden 4096 --vocab 128256 --tokens 1024,8192
    flce-autotune show [--cache PATH]
    flce-autotune clear [--cache PATH]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

import torch

from flce import config
from flce.autotune import cache as cache_files
from flce.autotune import locations
from flce.autotune.devices import device_name, dtype_name, torch_dtype
from flce.autotune.progress import Progress
from flce.autotune.schema import CROSS_ENTROPY_VARIANTS, VARIANT_NAMES, Entry
from flce.devices import cpu_fallback_reason, default_device


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at the interpreter's exit
        return code
    except _UsageError as exc:
        parser.error(str(exc))  # exits with status 2
    except BrokenPipeError:
        return closed_pipe_exit()
    return 2


def closed_pipe_exit() -> int:
    """The exit status of a command whose reader went away (`flce-autotune show | head`, `python -m flce info |
    head -1`): stop quietly, as cat does. stdout is pointed at devnull so that the interpreter's own flush at
    exit does not raise again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell reports for a command a closed pipe stopped


class _UsageError(ValueError):
    pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flce-autotune",
        description="Tune flce's block and chunk sizes per device and shape, and manage the cache they go to. "
                    f"Cache lookup order: --cache, ${locations.CACHE_ENV}, {locations.user_cache_path()}, "
                    "the defaults shipped with flce, the heuristic.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="{tune,show,clear}")

    tune = verbs.add_parser("tune", help="measure candidates on this machine and store the best per shape")
    tune.add_argument("--device", default=None,
                      help="torch device to tune (cuda, cuda:1, npu, cpu); default: the current accelerator, else cpu")
    tune.add_argument("--dtype", default=None,
                      help="comma-separated dtypes (bfloat16, float16, float32); default: bfloat16, float32 on cpu")
    tune.add_argument("--hidden", required=True, help="hidden size H, or several, comma-separated")
    tune.add_argument("--vocab", required=True, help="vocabulary size V, or several, comma-separated")
    tune.add_argument("--tokens", required=True, help="token counts (batch x sequence), comma-separated: 1024,4096")
    tune.add_argument("--memory-budget", default=None,
                      help="working memory any candidate may use beyond inputs and gradients, e.g. 512MiB, 2GiB")
    tune.add_argument("--quick", action="store_true", help="a small search space and few repeats (seconds on a CPU)")
    tune.add_argument("--cache", default=None,
                      help="cache file to write; if it cannot be written, tune fails before measuring (default: "
                           f"${locations.CACHE_ENV}, else the user cache, the first writable)")
    tune.add_argument("--backend", default=None,
                      help="backend to tune; default: the one flce dispatches to on this device")
    tune.add_argument("--variant", default=",".join(CROSS_ENTROPY_VARIANTS),
                      help="variants, comma-separated: plain, full (cross-entropy; the default both), distillation "
                           "(flce.linear_distillation_loss, JSD, a teacher of the student's hidden size)")
    tune.add_argument("--repeats", type=int, default=None, help="timed calls per candidate (median is kept)")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    tune.set_defaults(run=_tune)

    show = verbs.add_parser("show", help="print the cached entries of this machine's devices as a table")
    show.add_argument("--cache", default=None, help="one cache file (default: every file in lookup order)")
    show.add_argument("--all", action="store_true",
                      help="also entries for devices this machine does not have (e.g. the shipped GPU defaults)")
    show.set_defaults(run=_show)

    clear = verbs.add_parser("clear", help="delete flce's cache file (nothing else, no question asked)")
    clear.add_argument("--cache", default=None,
                       help=f"cache file to delete (default: ${locations.CACHE_ENV}, else the user cache)")
    clear.set_defaults(run=_clear)
    return parser


# tune ------------------------------------------------------------------------------------------


def _tune(args: argparse.Namespace) -> int:
    from flce.autotune.requests import TuneRequest, save_progressively
    from flce.autotune.tuner import Tuner

    device = _device(args.device)
    default_dtype = "float32" if device.type == "cpu" else "bfloat16"
    request = TuneRequest(
        device=device,
        dtypes=[_dtype(d) for d in _split("--dtype", args.dtype or default_dtype)],
        hiddens=_positive_ints("--hidden", args.hidden),
        vocabs=_positive_ints("--vocab", args.vocab),
        tokens=_positive_ints("--tokens", args.tokens),
        variants=_variants(args.variant),
        backend=args.backend,
        memory_budget=None if args.memory_budget is None else parse_bytes("--memory-budget", args.memory_budget),
        quick=args.quick,
        repeats=args.repeats,
    )
    if request.repeats is not None and request.repeats < 1:
        raise _UsageError(f"--repeats={request.repeats}: expected an int >= 1")
    progress = Progress(enabled=not args.no_progress)
    # Where the entries go is settled before anything is measured: an explicit --cache is honoured
    # or the command fails now, and a file that is not an flce cache is never replaced.
    try:
        target = cache_files.save_target(args.cache, lambda line: print(line, file=sys.stderr))
    except (OSError, cache_files.NotACacheError) as exc:
        print(f"flce-autotune: {exc}", file=sys.stderr)
        return 1
    saver = save_progressively(str(target), progress.write)
    try:
        tuner = Tuner(request, progress, on_result=saver)
    except (ValueError, RuntimeError) as exc:
        raise _UsageError(str(exc)) from None
    print(f"flce-autotune: tuning backend {tuner.backend!r} on {device_name(device)!r} ({device}); "
          f"{_shapes_text(request)}; writing to {target}", file=sys.stderr)
    interrupted, save_error = False, None
    try:
        tuner.run()
    except KeyboardInterrupt:
        interrupted = True
    except (OSError, cache_files.NotACacheError) as exc:  # the location changed since it was checked
        save_error = str(exc)
    results = tuner.results
    print(summary_table(results))
    for result in results:
        if result.skipped:
            counts = ", ".join(f"{n} {reason}" for reason, n in sorted(result.skipped.items()))
            first = f" (first: {result.first_error})" if result.first_error else ""
            print(f"  {_shape_label(result.shape)}: skipped {counts}{first}")
    written = saver.state.get("path")
    done = sum(1 for r in results if r.entry is not None)
    if written is not None:
        print(f"wrote {done} entr{'y' if done == 1 else 'ies'} to {written}")
    if save_error:
        print(f"flce-autotune: {save_error}", file=sys.stderr)
        return 1
    if interrupted:
        print("flce-autotune: interrupted; entries finished before the interruption were saved", file=sys.stderr)
        return 130
    return 0 if results and done == len(results) else 1


def _shapes_text(request) -> str:
    """'1 shape, plain and full variants': each (dtype, H, V, tokens) is tuned once per variant."""
    shapes = len(request.dtypes) * len(request.hiddens) * len(request.vocabs) * len(request.tokens)
    variants = request.variants
    names = variants[0] if len(variants) == 1 else ", ".join(variants[:-1]) + f" and {variants[-1]}"
    return f"{shapes} shape{'' if shapes == 1 else 's'}, {names} variant{'' if len(variants) == 1 else 's'}"


def summary_table(results: list) -> str:
    rows = []
    for r in results:
        entry = r.entry
        params = "-" if entry is None else (_params_text(entry.params) if entry.params
                                           else f"heuristic ({_params_text(r.heuristic_params or {})})")
        rows.append([
            _shape_label(r.shape), params, _ms(r.best_ms), _ms(r.heuristic_ms),
            "-" if r.speedup is None else f"{r.speedup:.2f}x",
            "-" if r.floor_ms is None or r.best_ms is None else f"{r.best_ms / r.floor_ms:.2f}x",
            "-" if r.peak_mib is None else f"{r.peak_mib:.1f}{'' if r.peak_kind == 'measured' else ' (est.)'}",
            "-" if entry is None else _limit_text(entry.logits_save_limit_bytes),
            str(sum(r.skipped.values())),
        ])
    headers = ["shape", "best params", "ms", "heuristic ms", "speed-up", "x floor", "peak MiB", "logits-save limit",
               "skipped"]
    return format_table(headers, rows)


# show / clear ----------------------------------------------------------------------------------


def _show(args: argparse.Namespace) -> int:
    sources = ([locations.Source("argument", _path(args.cache))] if args.cache is not None
               else locations.lookup_sources())
    here = None if args.all else local_device_names()
    for source in sources:
        loaded = cache_files.read_file(source.path)
        if loaded.status == cache_files.ABSENT:
            print(f"{source.path} ({source.describe()}): absent")
            continue
        if not loaded.usable:
            print(f"{source.path} ({source.describe()}): ignored: {loaded.problem}")
            continue
        count = len(loaded.entries)
        shown = loaded.entries if here is None else [e for e in loaded.entries if e.device in here]
        other = count - len(shown)
        elsewhere = f" ({other} for devices not on this machine: --all shows them)" if other else ""
        print(f"{source.path} ({source.describe()}): {count} entr{'y' if count == 1 else 'ies'}{elsewhere}")
        for problem in loaded.skipped:
            print(f"  ignored invalid {problem}")
        if shown:
            print(entries_table(shown))
    return 0


def local_device_names() -> set[str]:
    """The autotune names of the devices this process can use: the CPU and every accelerator."""
    names = {device_name(torch.device("cpu"))}
    for device_type in ("cuda", "npu", "xpu"):
        try:
            module = torch.get_device_module(device_type)
            count = module.device_count() if module.is_available() else 0
        except Exception:  # a device type whose module is missing or broken has no devices here
            count = 0
        names.update(device_name(torch.device(device_type, index)) for index in range(count))
    return names


def entries_table(entries: list[Entry]) -> str:
    headers = ["device", "backend", "variant", "dtype", "hidden", "vocab", "tokens", "params", "logits-save limit",
               "ms", "vs heuristic", "x floor", "peak MiB", "flce", "date"]
    rows = []
    for e in entries:
        m = e.measured
        floor = m.get("floor_ms")
        ms = m.get("ms")
        rows.append([
            e.device, e.backend, e.variant, e.dtype, str(e.hidden), str(e.vocab), str(e.tokens),
            _params_text(e.params) if e.params else "heuristic", _limit_text(e.logits_save_limit_bytes),
            _ms(ms), "-" if m.get("speedup") is None else f"{m['speedup']}x",
            f"{ms / floor:.2f}x" if _number(ms) and _number(floor) and floor > 0 else "-",
            "-" if m.get("peak_mib") is None else str(m["peak_mib"]),
            str(m.get("flce", "-")), str(m.get("date", "-"))[:10],
        ])
    return format_table(headers, rows)


def _clear(args: argparse.Namespace) -> int:
    path = _path(args.cache) if args.cache is not None else locations.write_targets()[0].path
    try:
        count = cache_files.remove_file(path)
    except FileNotFoundError:
        print(f"nothing to clear: {path} does not exist")
        return 0
    except ValueError as exc:
        print(f"flce-autotune: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"flce-autotune: cannot remove {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"removed {path} ({count} entr{'y' if count == 1 else 'ies'})")
    return 0


# Parsing and formatting ------------------------------------------------------------------------


def parse_bytes(name: str, text: str) -> int:
    """flce.config.parse_bytes, its error a usage error of this command."""
    try:
        return config.parse_bytes(name, text)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _split(name: str, text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise _UsageError(f"{name}={text!r}: expected one or more comma-separated values")
    return items


def _positive_ints(name: str, text: str) -> list[int]:
    values = []
    for item in _split(name, text):
        if not re.fullmatch(r"[0-9]+", item) or int(item) <= 0:
            raise _UsageError(f"{name}={text!r}: {item!r} is not a positive integer")
        values.append(int(item))
    return list(dict.fromkeys(values))


def _variants(text: str) -> list[str]:
    variants = _split("--variant", text)
    for v in variants:
        if v not in VARIANT_NAMES:
            raise _UsageError(f"--variant={text!r}: {v!r} is not one of {VARIANT_NAMES}")
    return list(dict.fromkeys(variants))


def _dtype(text: str) -> torch.dtype:
    try:
        return torch_dtype(text)
    except ValueError as exc:
        raise _UsageError(f"--dtype: {exc}") from None


def _device(text: str | None) -> torch.device:
    if text is None:
        reason = cpu_fallback_reason()
        if reason is not None:
            print(f"flce-autotune: {reason}: tuning the CPU", file=sys.stderr)
        return default_device()
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise _UsageError(f"--device={text!r}: not a device torch knows ({exc})") from None
    if device.type != "cpu":
        try:
            available = torch.get_device_module(device.type).is_available()
        except Exception:  # a device type whose module is missing (e.g. npu without torch_npu)
            available = False
        if not available:
            raise _UsageError(f"--device={text!r}: no {device.type} device is available in this process")
    return device


def _path(text: str):
    from pathlib import Path

    return Path(text).expanduser()


def _shape_label(shape) -> str:
    return f"{dtype_name(shape.dtype)} {shape.tokens}x{shape.hidden}x{shape.vocab} {shape.variant}"


def _params_text(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items()) or "-"


def _limit_text(limit: int | None) -> str:
    if limit is None:
        return "default"
    if limit == 0:
        return "0 (recompute)"
    return f"{limit / 2**20:.0f} MiB"


def _ms(value: object) -> str:
    return f"{value:.3f}" if _number(value) else "-"


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
