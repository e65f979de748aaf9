"""The autotune cache: file format, nearest-bucket lookup, lookup order, corruption handling,
concurrent writers, read-only fallback, and the reference planner reading it."""

from __future__ import annotations

import multiprocessing
import os
import re
import stat
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from helpers import assert_close_per_design, make_inputs, reference_loss
from planning import reference_bytes_per_row, reference_plan

import flce
import flce.autotune as autotune
from flce.autotune import cache as cache_files
from flce.autotune import files, locations
from flce.autotune.schema import FORMER_HEADERS, HEADER, Entry, SchemaError, entry_from_dict, merge, parse_document
from flce.backends.reference.plan import DEFAULT_CHUNK_BUDGET
from flce.config import LCEConfig
from flce.engine.plans import TokenChunks
from flce.inputs import prepare_inputs

CPU = torch.device("cpu")


@pytest.fixture
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Every lookup location points into tmp_path: no real user cache, no shipped defaults."""
    paths = {"user": tmp_path / "xdg" / "flce" / "autotune.yaml", "defaults": tmp_path / "defaults",
             "env": tmp_path / "env" / "autotune.yaml", "arg": tmp_path / "arg" / "autotune.yaml"}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(locations.CACHE_ENV, raising=False)
    monkeypatch.setattr(locations, "DEFAULTS_DIR", paths["defaults"])
    autotune.reload()
    yield paths
    autotune.reload()


def entry(**changes: object) -> Entry:
    fields = dict(device=autotune.device_name(CPU), backend="reference", variant="plain", dtype="float32",
                  hidden=16, vocab=40, tokens=64, params={"tokens_per_chunk": 8}, logits_save_limit_bytes=1 << 20,
                  measured={"ms": 1.5, "flce": "0.1.0"})
    fields.update(changes)
    return Entry(**fields)


def write(path: Path, entries: list[Entry]) -> None:
    cache_files.update_file(path, entries)


# Format ------------------------------------------------------------------------------------------


def test_round_trip_keeps_every_field_and_the_header(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    entries = [entry(), entry(variant="full", params={"tokens_per_chunk": 16, "block_v": 512, "mode": "x"},
                              logits_save_limit_bytes=None, measured={}),
               entry(dtype="bfloat16", tokens=4096, logits_save_limit_bytes=0)]
    write(path, entries)
    text = path.read_text()
    assert text.startswith(HEADER + "\n")
    loaded = cache_files.read_file(path)
    assert loaded.status == cache_files.OK and not loaded.skipped
    assert loaded.entries == entries
    assert all(e.source == str(path.absolute()) for e in loaded.entries)


def test_update_merges_by_key_and_keeps_order_and_notes(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(cache_files.render([entry(tokens=64), entry(tokens=128)], ["# made by: flce-autotune tune ..."]))
    newer = entry(tokens=64, params={"tokens_per_chunk": 32})
    write(path, [newer, entry(tokens=256)])
    assert [(e.tokens, e.params["tokens_per_chunk"]) for e in cache_files.read_file(path).entries] == [
        (64, 32), (128, 8), (256, 8)]
    assert path.read_text().splitlines()[:2] == [HEADER, "# made by: flce-autotune tune ..."]
    assert merge([entry(tokens=1)], [entry(tokens=1, params={})]) == [entry(tokens=1, params={})]


@pytest.mark.parametrize("header", FORMER_HEADERS)
def test_a_file_with_a_former_header_stays_flces_and_gets_the_current_one(tmp_path: Path, header: str) -> None:
    """Cache files already on disk carry the header of their day: a truncated one is still flce's (so
    `clear` may delete it), and an update writes the current header once, keeping the notes below it."""
    path = tmp_path / "c.yaml"
    text = cache_files.render([entry(tokens=64)], ["# made by: flce-autotune tune ..."])
    path.write_text(text.replace(HEADER, header, 1))
    truncated = tmp_path / "truncated.yaml"
    truncated.write_text(header + "\nschema: 1\nentries:\n- {device: d, backend")
    assert cache_files.is_flce_file(truncated)
    write(path, [entry(tokens=128)])
    assert path.read_text().splitlines()[:3] == [HEADER, "# made by: flce-autotune tune ...", "schema: 1"]
    assert [e.tokens for e in cache_files.read_file(path).entries] == [64, 128]


def test_the_header_names_a_document_the_repository_ships() -> None:
    """The header tells whoever opens a cache file where its format is described."""
    cited = re.findall(r"[\w/.-]+\.md", HEADER)
    assert cited == ["docs/design.md"] and (Path(__file__).resolve().parents[1] / cited[0]).is_file()


@pytest.mark.parametrize("change, message", [
    ({"hidden": 0}, "hidden=0: expected a positive int"),
    ({"tokens": True}, "tokens=True: expected a positive int"),
    ({"vocab": "40"}, "vocab='40': expected a positive int"),
    ({"variant": "fast"}, "variant='fast': expected one of"),
    ({"device": ""}, "device='': expected a non-empty string"),
    ({"params": [1, 2]}, "params=[1, 2]: expected a mapping"),
    ({"params": {"block": [1]}}, "params {'block': [1]}: expected numbers"),
    ({"logits_save_limit_bytes": -1}, "logits_save_limit_bytes=-1: expected null or a byte count"),
    ({"params": {"tokens_per_chunk": 0}}, "params tokens_per_chunk=0: expected a positive int"),
    ({"params": {"tokens_per_chunk": -5}}, "params tokens_per_chunk=-5: expected a positive int"),
    ({"params": {"tokens_per_chunk": "abc"}}, "params tokens_per_chunk='abc': expected a positive int"),
    ({"params": {"gemm_block_m": 64.0}}, "params gemm_block_m=64.0: expected a positive int"),
])
def test_invalid_entries_name_the_field(change: dict, message: str) -> None:
    raw = {**entry().to_dict(), **change}
    with pytest.raises(SchemaError, match=message.replace("[", r"\[").replace("(", r"\(")):
        entry_from_dict(raw)


def test_missing_fields_are_listed_and_odd_measured_values_are_dropped() -> None:
    raw = entry().to_dict()
    del raw["vocab"], raw["params"]
    with pytest.raises(SchemaError, match="missing vocab, params"):
        entry_from_dict(raw)
    odd = {**entry().to_dict(), "measured": {"ms": 2.0, "curve": [1, 2], "note": "ok"}, "future_key": 1}
    assert entry_from_dict(odd).measured == {"ms": 2.0, "note": "ok"}


def test_one_bad_entry_is_skipped_not_the_file() -> None:
    good = entry().to_dict()
    entries, problems = parse_document({"schema": 1, "entries": [good, {**good, "hidden": -3}, "junk"]})
    assert entries == [entry()]
    assert problems == ["entry 1: hidden=-3: expected a positive int", "entry 2: expected a mapping, got a str"]


# Nearest bucket ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, bucket", [
    (0, 1024), (1, 1024), (1024, 1024), (2000, 1024), (2048, 4096), (3000, 4096), (8000, 4096),
    (8300, 16384), (10**7, 16384),
])
def test_nearest_token_bucket_by_ratio(cache_env: dict[str, Path], tokens: int, bucket: int) -> None:
    write(cache_env["user"], [entry(tokens=t, params={"tokens_per_chunk": t // 8}) for t in (16384, 1024, 4096)])
    found = autotune.lookup("cpu", torch.float32, hidden=16, vocab=40, tokens=tokens, backend="reference",
                            variant="plain")
    assert found is not None and found.tokens == bucket
    assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, tokens) == (
        {"tokens_per_chunk": bucket // 8}, 1 << 20)


def test_other_shapes_dtypes_devices_and_variants_do_not_match(cache_env: dict[str, Path]) -> None:
    write(cache_env["user"], [entry(), entry(backend="cuda", variant="full", tokens=512, params={"block_v": 64})])
    kwargs = dict(hidden=16, vocab=40, tokens=64)
    assert autotune.lookup("cpu", "float32", **kwargs, backend="reference") == entry()
    assert autotune.lookup("cpu", "float32", **kwargs, variant="full").backend == "cuda"
    assert autotune.lookup("cpu", "fp32", **kwargs) is not None  # dtype spellings are normalised
    assert autotune.lookup("cpu", torch.bfloat16, **kwargs) is None
    assert autotune.lookup("cpu", torch.float32, hidden=17, vocab=40, tokens=64) is None
    assert autotune.lookup("cpu", torch.float32, hidden=16, vocab=41, tokens=64) is None
    assert autotune.lookup("NVIDIA H100 80GB HBM3", torch.float32, **kwargs) is None
    assert autotune.lookup(autotune.device_name(CPU), torch.float32, **kwargs) is not None
    assert autotune.tuned_params(CPU, "reference", "full", torch.float32, 16, 40, 64) == (None, None)


def test_lookup_rejects_bad_arguments(cache_env: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="tokens=-1: expected an int >= 0"):
        autotune.lookup("cpu", torch.float32, hidden=16, vocab=40, tokens=-1)
    with pytest.raises(ValueError, match="variant='fast'"):
        autotune.lookup("cpu", torch.float32, hidden=16, vocab=40, tokens=1, variant="fast")
    with pytest.raises(ValueError, match="dtype='int7'"):
        autotune.lookup("cpu", "int7", hidden=16, vocab=40, tokens=1)


# Lookup order ------------------------------------------------------------------------------------


def test_lookup_order_argument_env_user_shipped_heuristic(
    cache_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = {"arg": 3, "env": 5, "user": 7}
    for name, chunk in layers.items():
        write(cache_env[name], [entry(params={"tokens_per_chunk": chunk})])
    cache_env["defaults"].mkdir()
    write(cache_env["defaults"] / "some-gpu.yaml", [entry(params={"tokens_per_chunk": 9})])
    monkeypatch.setenv(locations.CACHE_ENV, str(cache_env["env"]))

    def chunk(cache: Path | None = None) -> int | None:
        found = autotune.lookup("cpu", torch.float32, hidden=16, vocab=40, tokens=64, cache=cache)
        return None if found is None else found.params["tokens_per_chunk"]

    assert [s.kind for s in locations.lookup_sources(cache_env["arg"])] == ["argument", "env", "user", "shipped"]
    assert chunk(cache_env["arg"]) == 3
    assert chunk() == 5
    monkeypatch.delenv(locations.CACHE_ENV)
    assert chunk() == 7
    cache_env["user"].unlink()
    autotune.reload()  # files are parsed once per process; deleting one behind its back needs a reload
    assert chunk() == 9
    (cache_env["defaults"] / "some-gpu.yaml").unlink()
    autotune.reload()
    assert chunk() is None


def test_first_source_holding_the_shape_answers_with_its_own_nearest_bucket(cache_env: dict[str, Path]) -> None:
    write(cache_env["user"], [entry(tokens=1024, params={"tokens_per_chunk": 1})])
    cache_env["defaults"].mkdir()
    write(cache_env["defaults"] / "d.yaml", [entry(tokens=8192, params={"tokens_per_chunk": 2}),
                                             entry(hidden=32, params={"tokens_per_chunk": 3})])
    assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, 8192)[0] == {"tokens_per_chunk": 1}
    # A shape the user never tuned still gets the shipped default.
    assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 32, 40, 64)[0] == {"tokens_per_chunk": 3}


def test_tuned_params_sees_environment_changes_and_saves(
    cache_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    query = (CPU, "reference", "plain", torch.float32, 16, 40, 64)
    assert autotune.tuned_params(*query) == (None, None)
    write(cache_env["env"], [entry(params={"tokens_per_chunk": 5})])
    monkeypatch.setenv(locations.CACHE_ENV, str(cache_env["env"]))
    assert autotune.tuned_params(*query)[0] == {"tokens_per_chunk": 5}
    write(cache_env["env"], [entry(params={"tokens_per_chunk": 6})])  # a save in this process is seen at once
    assert autotune.tuned_params(*query)[0] == {"tokens_per_chunk": 6}
    params, _ = autotune.tuned_params(*query)
    params["tokens_per_chunk"] = 99  # callers get a copy
    assert autotune.tuned_params(*query)[0] == {"tokens_per_chunk": 6}


def test_override_params_wins_for_its_backend_only(cache_env: dict[str, Path]) -> None:
    write(cache_env["user"], [entry()])
    query = (CPU, "reference", "plain", torch.float32, 16, 40, 64)
    with autotune.override_params({"tokens_per_chunk": 2}, 123, backend="reference"):
        assert autotune.tuned_params(*query) == ({"tokens_per_chunk": 2}, 123)
        with autotune.override_params(None):
            assert autotune.tuned_params(*query) == (None, None)
        assert autotune.tuned_params(*query) == ({"tokens_per_chunk": 2}, 123)
    with autotune.override_params({"block_v": 4}, backend="cuda"):
        assert autotune.tuned_params(*query) == ({"tokens_per_chunk": 8}, 1 << 20)
    assert autotune.tuned_params(*query) == ({"tokens_per_chunk": 8}, 1 << 20)
    with pytest.raises(ValueError, match="logits_save_limit_bytes=-5"):
        with autotune.override_params({}, -5):
            pass


def test_info_lines_list_sources_and_say_whether_a_shape_hits(cache_env: dict[str, Path]) -> None:
    write(cache_env["user"], [entry(tokens=128)])
    lines = autotune.info_lines("cpu", "float32", 16, 40, 100)
    text = "\n".join(lines)
    assert f"user cache: {cache_env['user']}: read, 1 entries (1 for this device)" in text
    assert "hit: reference/plain -> tokens_per_chunk=8; logits-save limit 1 MiB (bucket tokens=128" in text
    miss = "\n".join(autotune.info_lines("cpu", "float32", 16, 41, 100))
    assert "no cached entry; backends use their heuristic" in miss
    assert not any("shape" in line for line in autotune.info_lines("cpu"))


# Corruption --------------------------------------------------------------------------------------

VALID = HEADER + "\nschema: 1\nentries:\n- {device: d, backend: reference, variant: plain, dtype: float32, " \
        "hidden: 16, vocab: 40, tokens: 64, params: {tokens_per_chunk: 8}}\n"
CORRUPT_FILES = {
    "empty": ("", "the file is empty"),
    "whitespace": ("\n  \n", "the file is empty"),
    "truncated": (VALID[: VALID.index("tokens_per_chunk") + 5], "not valid YAML"),
    "binary yaml error": ("schema: 1\nentries: [\x07]", "not valid YAML"),
    "a schema that never was": ("schema: 0\nentries: []\n", "schema=0: this flce reads schema 1"),
    "entries not a list": ("schema: 1\nentries: {a: 1}\n", "entries: expected a list, got a dict"),
}
# Files that do not say they are flce caches: ignored by lookups alike, but never replaced.
FOREIGN_FILES = {
    "not utf-8": (b"\xff\xfe\x00garbage", "cannot be read"),
    "a list": ("- 1\n- 2\n", "expected a mapping with 'schema' and 'entries' at the top, got a list"),
    "someone else's yaml": ("name: my-project\nversion: 3\n", "no 'schema' key"),
    "a shell rc file": ("export PATH=$HOME/bin:$PATH\nalias ll='ls -l'\n", "expected a mapping"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_FILES))
def test_corrupt_file_is_reported_once_ignored_and_moved_aside_by_a_save(
    cache_env: dict[str, Path], case: str
) -> None:
    content, problem = CORRUPT_FILES[case]
    path = cache_env["user"]
    path.parent.mkdir(parents=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    cache_env["defaults"].mkdir()
    write(cache_env["defaults"] / "d.yaml", [entry(params={"tokens_per_chunk": 4})])

    with pytest.warns(RuntimeWarning, match="ignoring autotune cache") as caught:
        first = autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, 64)
    messages = [str(w.message) for w in caught if "autotune" in str(w.message)]
    assert len(messages) == 1 and str(path.absolute()) in messages[0] and problem in messages[0]
    assert first == ({"tokens_per_chunk": 4}, 1 << 20)  # the next source answers
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once: later lookups are silent
        assert autotune.lookup("cpu", "float32", hidden=16, vocab=40, tokens=64).params == {"tokens_per_chunk": 4}
        assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, 65)[0] is not None

    logged: list[str] = []
    result = cache_files.save_entries([entry(params={"tokens_per_chunk": 2})], log=logged.append)
    assert result.path == path.absolute() and result.moved_aside is not None
    assert result.moved_aside.name.startswith("autotune.yaml.corrupt-")
    original = content if isinstance(content, bytes) else content.encode()
    assert result.moved_aside.read_bytes() == original
    assert len(logged) == 1 and "moved it to" in logged[0] and str(path) in logged[0]
    assert [e.params for e in cache_files.read_file(path).entries] == [{"tokens_per_chunk": 2}]
    assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, 64)[0] == {"tokens_per_chunk": 2}


NEWER_SCHEMA = ("schema: 2\nentries:\n- {device: d, tokens: 64, new_field: 1, measured: {flce: 0.4.0}}\n",
                "schema: 2.5\nentries: []\n")


@pytest.mark.parametrize("content", NEWER_SCHEMA, ids=["schema-2-by-flce-0.4.0", "schema-2.5"])
def test_a_newer_schema_is_ignored_and_never_replaced(cache_env: dict[str, Path], content: str) -> None:
    """A file a newer flce wrote: lookups here ignore it (once reported), and a save refuses to replace
    it, saying which flce reads it, instead of moving it aside and writing schema 1 in its place."""
    path = cache_env["user"]
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="written by a newer flce"):
        assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, 64) == (None, None)
    schema = content.split()[1]
    for attempt in (lambda: cache_files.save_entries([entry()], log=lambda _: None),
                    lambda: cache_files.save_target(log=lambda _: None)):
        with pytest.raises(cache_files.NotACacheError, match=rf"schema {schema}.*reads schema 1.*refusing") as caught:
            attempt()
        if "0.4.0" in content:
            assert "flce 0.4.0" in str(caught.value)
    assert path.read_text() == content
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name], "nothing moved aside, no lock file left"


def test_schema_written_as_a_float_one_is_schema_one(cache_env: dict[str, Path]) -> None:
    path = cache_env["user"]
    path.parent.mkdir(parents=True)
    path.write_text(VALID.replace("schema: 1", "schema: 1.0").replace("device: d", f"device: '{entry().device}'"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, 64)[0] == {"tokens_per_chunk": 8}
    assert cache_files.save_entries([entry(tokens=128)], log=lambda _: None).moved_aside is None
    assert [e.tokens for e in cache_files.read_file(path).entries] == [64, 128]


@pytest.mark.parametrize("case", sorted(FOREIGN_FILES))
def test_a_file_that_is_not_a_cache_is_ignored_and_never_replaced(cache_env: dict[str, Path], case: str) -> None:
    content, problem = FOREIGN_FILES[case]
    path = cache_env["user"]
    path.parent.mkdir(parents=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    original = path.read_bytes()
    with pytest.warns(RuntimeWarning, match="ignoring autotune cache") as caught:
        assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, 64) == (None, None)
    assert any(problem in str(w.message) for w in caught)
    for attempt in (lambda: cache_files.save_entries([entry()], log=lambda _: None),
                    lambda: cache_files.save_target(log=lambda _: None)):
        with pytest.raises(cache_files.NotACacheError, match=r"is not an flce autotune cache.*refusing to replace"):
            attempt()
    assert path.read_bytes() == original
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name], "nothing moved aside, no lock file left"


def test_file_with_some_bad_entries_keeps_the_good_ones(cache_env: dict[str, Path]) -> None:
    path = cache_env["user"]
    path.parent.mkdir(parents=True)
    bad = {**entry(tokens=128).to_dict(), "tokens": "many"}
    path.write_text(cache_files.render([entry()]) + "- " + repr(bad).replace("'", "") + "\n")
    with pytest.warns(RuntimeWarning, match=r"ignoring 1 invalid entry \(entry 1: tokens='many'"):
        assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, 64)[0] == {"tokens_per_chunk": 8}
    result = cache_files.save_entries([entry(tokens=256)], log=lambda _: None)
    assert result.moved_aside is not None and "tokens: many" in result.moved_aside.read_text()
    assert [e.tokens for e in cache_files.read_file(path).entries] == [64, 256]


def test_stale_entries_from_other_versions_fall_back_to_the_heuristic(cache_env: dict[str, Path]) -> None:
    """Knobs no backend can use make their entry invalid, with the warning any invalid field gets."""
    stale = [{**entry(tokens=tokens).to_dict(), "params": {"tokens_per_chunk": value}}
             for tokens, value in ((64, "auto"), (4096, -3), (16384, True), (128, 0))]
    cache_env["user"].parent.mkdir(parents=True)
    cache_env["user"].write_text(yaml.safe_dump({"schema": 1, "entries": stale}))
    with pytest.warns(RuntimeWarning, match=r"ignoring 4 invalid entries \(entry 0: params tokens_per_chunk='auto'"):
        autotune.reload()
        assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, 64) == (None, None)
    for n in (64, 4096, 16384):
        flat = prepare_inputs(torch.randn(n, 16), torch.randn(40, 16), torch.randint(0, 40, (n,)), None, LCEConfig())
        heuristic = min(n, DEFAULT_CHUNK_BUDGET // reference_bytes_per_row(flat))
        assert reference_plan(flat, LCEConfig()).tokens_per_chunk == heuristic


# Concurrency and permissions ---------------------------------------------------------------------


def _concurrent_writer(path: str, writer: int, count: int, barrier: object) -> None:
    barrier.wait()
    for i in range(count):
        cache_files.update_file(path, [entry(hidden=100 + writer, tokens=1 + i, measured={"writer": writer})])


def test_concurrent_writers_lose_no_entry(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "autotune.yaml"
    writers, count = 4, 10
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    barrier = context.Barrier(writers)
    processes = [context.Process(target=_concurrent_writer, args=(str(path), w, count, barrier))
                 for w in range(writers)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=120)
    assert [p.exitcode for p in processes] == [0] * writers
    loaded = cache_files.read_file(path)
    assert loaded.status == cache_files.OK and not loaded.skipped
    assert sorted((e.hidden, e.tokens) for e in loaded.entries) == sorted(
        (100 + w, 1 + i) for w in range(writers) for i in range(count))
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_unwritable_env_location_falls_back_to_the_user_cache_with_a_message(
    cache_env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    unwritable = blocker / "autotune.yaml"  # fails for root too: a path under a regular file
    monkeypatch.setenv(locations.CACHE_ENV, str(unwritable))
    for save in (lambda log: cache_files.save_entries([entry()], log=log).path,
                 lambda log: cache_files.save_target(log=log)):
        logged: list[str] = []
        assert save(logged.append) == cache_env["user"].absolute()
        assert len(logged) == 1 and f"cannot write {unwritable}" in logged[0] and str(cache_env["user"]) in logged[0]
    assert cache_files.read_file(cache_env["user"]).entries == [entry()]


def test_an_explicit_path_is_honoured_or_the_save_fails(cache_env: dict[str, Path], tmp_path: Path) -> None:
    """cache= names the one file to write: no fallback to another location, before or after tuning."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    unwritable = blocker / "autotune.yaml"
    for save in (lambda: cache_files.save_entries([entry()], cache=unwritable, log=lambda _: None),
                 lambda: cache_files.save_target(unwritable, log=lambda _: None)):
        with pytest.raises(OSError, match="no writable autotune cache location") as caught:
            save()
        assert str(unwritable) in str(caught.value)
    assert not cache_env["user"].exists()
    writable = tmp_path / "mine" / "autotune.yaml"
    with pytest.raises(OSError, match=f"no folder {writable.parent}"):  # a mistyped folder is not created
        cache_files.save_target(writable, log=lambda _: None)
    assert not writable.parent.exists()
    writable.parent.mkdir()
    assert cache_files.save_target(writable, log=lambda _: None) == writable.absolute()
    assert not writable.exists(), "checking a location writes no file"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root ignores directory permissions; the path-under-a-file test covers root")
def test_read_only_directory_falls_back(cache_env: dict[str, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv(locations.CACHE_ENV, str(read_only / "autotune.yaml"))
    try:
        logged: list[str] = []
        result = cache_files.save_entries([entry()], log=logged.append)
    finally:
        read_only.chmod(stat.S_IRWXU)
    assert result.path == cache_env["user"].absolute()
    assert "Permission denied" in logged[0]


def test_no_writable_location_raises_with_every_reason(
    cache_env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setenv(locations.CACHE_ENV, str(blocker / "x.yaml"))
    for save in (lambda: cache_files.save_entries([entry()], log=lambda _: None),
                 lambda: cache_files.save_target(log=lambda _: None)):  # what tune checks before measuring
        with pytest.raises(OSError, match="no writable autotune cache location") as caught:
            save()
        assert str(blocker / "x.yaml") in str(caught.value) and str(blocker / "flce") in str(caught.value)


def test_remove_file_deletes_only_flce_files(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    write(path, [entry()])
    assert cache_files.remove_file(path) == 1
    assert not path.exists() and not (tmp_path / "c.yaml.lock").exists()
    truncated = tmp_path / "t.yaml"
    truncated.write_text(cache_files.render([entry()])[:120])  # ours: the header survives truncation
    assert cache_files.remove_file(truncated) == 0 and not truncated.exists()
    other = tmp_path / "other.yaml"
    other.write_text("name: something else\n")
    with pytest.raises(ValueError, match="not an flce autotune cache; left untouched"):
        cache_files.remove_file(other)
    assert other.read_text() == "name: something else\n"
    with pytest.raises(FileNotFoundError):
        cache_files.remove_file(tmp_path / "absent.yaml")


# Files that are not regular files ----------------------------------------------------------------


def _finishes(action, fifo: Path | None = None, timeout_s: float = 30.0):
    """Run ``action`` in a thread; fail if it has not returned within ``timeout_s`` (a read blocked on a
    FIFO with no writer), unblocking it by opening the FIFO's other end. Returns the action's result."""
    import threading

    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = action()
        except BaseException as exc:  # re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY))  # the blocked reader sees end of file
        thread.join(timeout_s)
        pytest.fail(f"blocked for more than {timeout_s} s on {fifo}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("where", ["user", "env", "arg"])
def test_a_fifo_at_a_cache_path_never_blocks_and_is_never_replaced(cache_env: dict[str, Path], where: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   generator: torch.Generator) -> None:
    """A lookup, a training call (the reference planner reads the cache), show's read and a tune's save
    each return at once: only regular files are read. The FIFO is reported, ignored, and left in place."""
    fifo = cache_env[where]
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    if where == "env":
        monkeypatch.setenv(locations.CACHE_ENV, str(fifo))
    cache = fifo if where == "arg" else None
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert _finishes(lambda: autotune.lookup("cpu", "float32", hidden=16, vocab=40, tokens=64, cache=cache),
                         fifo) is None
    if where != "arg":
        hidden, weight, target, _ = make_inputs((8,), 16, 40, generator=generator)
        loss = _finishes(lambda: flce.linear_cross_entropy(hidden, weight.requires_grad_(), target), fifo)
        assert torch.isfinite(loss)
    assert _finishes(lambda: cache_files.read_file(fifo), fifo).status == cache_files.INVALID
    for save in (lambda: cache_files.save_entries([entry()], cache=cache, log=lambda _: None),
                 lambda: cache_files.save_target(cache, log=lambda _: None)):
        with pytest.raises(cache_files.NotACacheError, match="not a regular file"):
            _finishes(save, fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in fifo.parent.iterdir()) == [fifo.name], "nothing moved aside, no lock file"
    with pytest.raises(ValueError, match="not an flce autotune cache; left untouched"):
        _finishes(lambda: cache_files.remove_file(fifo), fifo)


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_a_device_file_as_the_cache_is_not_read(cache_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A device is not a cache file, whatever it holds (/dev/zero would never end)."""
    monkeypatch.setenv(locations.CACHE_ENV, "/dev/null")
    with pytest.warns(RuntimeWarning, match="is a character device, not a regular file"):
        assert autotune.tuned_params(CPU, "reference", "plain", torch.float32, 16, 40, 64) == (None, None)


def test_an_oversized_cache_file_is_read_no_further_than_the_limit(cache_env: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = cache_env["user"]
    write(path, [entry()])
    monkeypatch.setattr(files, "MAX_FILE_BYTES", path.stat().st_size - 1)
    loaded = cache_files.read_file(path)
    assert loaded.status == cache_files.INVALID and "larger than" in loaded.problem


# The reference planner ---------------------------------------------------------------------------


def test_reference_planner_uses_cached_chunk_and_limit_and_stays_correct(
    cache_env: dict[str, Path], generator: torch.Generator
) -> None:
    hidden, weight, target, _ = make_inputs((3, 23), 16, 40, generator=generator)
    n = target.numel()
    write(cache_env["user"], [
        entry(tokens=64, params={"tokens_per_chunk": 5}, logits_save_limit_bytes=0),
        entry(variant="full", tokens=64, params={"tokens_per_chunk": 7}, logits_save_limit_bytes=1 << 30),
    ])
    flat = prepare_inputs(hidden, weight, target, None, LCEConfig())
    assert reference_plan(flat, LCEConfig()) == TokenChunks(5)
    full_cfg = LCEConfig(label_smoothing=0.1)
    assert reference_plan(flat, full_cfg) == TokenChunks(7, saved_rows=n)
    # An explicit memory budget still bounds the cached chunk.
    budget = 3 * reference_bytes_per_row(flat)
    assert reference_plan(flat, LCEConfig(memory_budget=budget)).tokens_per_chunk == 3
    assert n == 69 and n % 5 and n % 7  # ragged last chunks are exercised

    for options in ({}, {"label_smoothing": 0.1, "reduction": "none"}):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = flce.linear_cross_entropy(h, w, target, backend="reference", **options)
        loss.sum().backward()
        h64 = hidden.double().requires_grad_()
        w64 = weight.double().requires_grad_()
        expected = reference_loss(h64, w64, target, **options).loss
        expected.sum().backward()
        assert_close_per_design(loss, expected, kind="forward", dtype=torch.float32, name="loss")
        assert_close_per_design(h.grad, h64.grad, kind="grad_hidden", dtype=torch.float32, name="grad hidden")
        assert_close_per_design(w.grad, w64.grad, kind="grad_weight", dtype=torch.float32, name="grad weight")


def test_tuned_params_under_torch_compile_matches_eager(cache_env: dict[str, Path]) -> None:
    write(cache_env["user"], [entry(tokens=64, params={"tokens_per_chunk": 5}), entry(tokens=4096, params={})])

    def chunked_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        params, _ = autotune.tuned_params(x.device, "reference", "plain", x.dtype, x.shape[1], w.shape[0], x.shape[0])
        step = (params or {}).get("tokens_per_chunk", x.shape[0])
        return torch.stack([(x[s:s + step] @ w.t()).logsumexp(1).sum() for s in range(0, x.shape[0], step)]) * step

    w = torch.randn(40, 16)
    torch._dynamo.reset()
    compiled = torch.compile(chunked_sum, fullgraph=True, dynamic=True, backend="eager")
    for n in (64, 70, 3000):  # 5-row chunks, 5-row chunks (nearest bucket), one chunk
        x = torch.randn(n, 16)
        torch.testing.assert_close(compiled(x, w), chunked_sum(x, w))
    with autotune.override_params({"tokens_per_chunk": 11}):
        x = torch.randn(64, 16)
        assert compiled(x, w).shape == (6,)


def test_shipped_defaults_are_valid_and_say_how_they_were_made() -> None:
    files = sorted(locations.DEFAULTS_DIR.glob("*.yaml"))
    assert files, f"no shipped defaults in {locations.DEFAULTS_DIR}: the H100 and H200 files ship with flce"
    for path in files:
        loaded = cache_files.read_file(path)
        assert loaded.status == cache_files.OK and not loaded.skipped, (path, loaded.problem, loaded.skipped)
        assert any(line.startswith("# made by:") for line in cache_files.leading_comments(path)), path
        for e in loaded.entries:
            assert {"flce", "torch", "date", "ms", "heuristic_ms"} <= set(e.measured), (path, e.key)
            if e.measured.get("budget_from") != "argument":  # the heuristic fitted: never slower than it
                assert e.measured["ms"] <= e.measured["heuristic_ms"], (path, e.key)
