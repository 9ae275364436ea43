"""The signature catalogue: schema validation, coverage of the taxonomy, benign look-alikes,
user rule folders."""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forensics import diagnose as dg
from forensics import pipeline
from forensics import catalogue as sig
from forensics.diagnosis import matching
from forensics.cli import app

from .conftest import CORPUS

TAXONOMY = CORPUS.parent / "taxonomy.yaml"


@pytest.fixture(scope="module")
def catalogue() -> sig.Catalogue:
    return sig.load()


def test_builtin_catalogue_loads_and_compiles_in_duckdb(catalogue):
    assert len(catalogue.rules) > 40
    sig.check_with_duckdb(catalogue)  # RE2 accepts every pattern
    ids = [r.id for r in catalogue.rules]
    assert len(ids) == len(set(ids))
    for r in catalogue.rules:
        assert r.keywords or r.keywords_ci or not r.patterns, f"{r.id} has no prefilter keyword"
        assert r.source.endswith(".yaml")


def test_every_class_has_remediation_or_is_healthy(catalogue):
    for cid, info in catalogue.classes.items():
        if cid != "healthy":
            assert info.remediation, f"class {cid} has no remediation"


def _taxonomy_classes() -> set[str]:
    if not TAXONOMY.exists():
        pytest.skip(f"taxonomy not found at {TAXONOMY}")
    # the file is YAML-like but its descriptions hold unquoted colons: read the keys
    return set(re.findall(r"^  ([a-z_]+):", TAXONOMY.read_text(), flags=re.M))


def test_classes_file_is_the_taxonomy(catalogue):
    assert set(catalogue.classes) == _taxonomy_classes()


def test_every_taxonomy_class_is_covered(catalogue):
    covered = catalogue.covered_classes()
    missing = _taxonomy_classes() - covered
    assert not missing, f"no rule or detector for {sorted(missing)}"


@pytest.mark.parametrize("patterns, want_cs, want_ci", [
    (["OutOfMemoryError: CUDA out of memory"], ("OutOfMemoryError: CUDA out of memory",), ()),
    ([r"Killing \d+ worker\(s\), kill details"], (" worker(s), kill details",), ()),
    ([r"(?i)\b(?:still pending|is stuck)"], (), ("still pending", "is stuck")),
    ([r"NVRM: Xid \(PCI:[0-9a-f:]+\): (?:48|79)\b"], ("NVRM: Xid (PCI:",), ()),
])
def test_keyword_derivation(patterns, want_cs, want_ci):
    assert sig.derive_keywords(patterns, "t") == (want_cs, want_ci)


def _write_rules(folder: Path, text: str, name: str = "mine.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(textwrap.dedent(text))
    return folder


@pytest.mark.parametrize("body, message", [
    ("""
     rules:
       - id: x1
         class: disk_full
         role: cause
         patterns: ['No space']
         colour: red
     """, "unknown field"),
    ("""
     rules:
       - id: x2
         class: not_a_class
         role: cause
         patterns: ['No space left']
     """, "not a taxonomy class"),
    ("""
     rules:
       - id: x3
         class: disk_full
         role: culprit
         patterns: ['No space left']
     """, "role"),
    ("""
     rules:
       - id: x4
         class: disk_full
         role: cause
         patterns: ['No (space']
     """, "bad regular expression"),
    ("""
     rules:
       - id: x5
         class: disk_full
         role: cause
         patterns: ['(?<=disk )full']
     """, "look-around"),
    ("""
     rules:
       - id: x6
         class: disk_full
         role: cause
         patterns: ['\\d+ \\w+']
     """, "prefilter keyword"),
    ("""
     rules:
       - id: x7
         class: disk_full
         role: cause
         patterns: ['No space left']
         requires: [no_such_rule]
     """, "unknown rule"),
    ("""
     rules:
       - id: Bad-Id
         class: disk_full
         role: cause
         patterns: ['No space left']
     """, "lower_snake_case"),
    ("""
     rules:
       - id: x8
         class: oom_training
         role: cause
         patterns: ['CUDA out of memory']
         class_by_phase: {warmup: oom_generation}
     """, "not a phase"),
    ("""
     rules: []
     metrics_detector: {}
     """, "unknown section"),
])
def test_schema_errors_name_the_rule(tmp_path, body, message):
    folder = _write_rules(tmp_path / "rules", body)
    with pytest.raises(sig.SignatureError) as exc:
        sig.load([folder])
    assert message in str(exc.value)
    assert "mine.yaml" in str(exc.value)


def test_relayed_ranks_need_their_group_and_re2(tmp_path):
    """A relayed_ranks pattern names the rank in the group `ranks`, and DuckDB's RE2 must
    accept it (the diagnosis runs it there)."""
    with pytest.raises(sig.SignatureError, match="needs the group"):
        sig.load([_write_rules(tmp_path / "a", "relayed_ranks: ['RANK (\\d+)']")])
    cat = sig.load([_write_rules(tmp_path / "b", "relayed_ranks: ['RANK (?P<ranks>\\d++)']")])
    with pytest.raises(sig.SignatureError, match="relayed_ranks: RE2 rejects"):
        sig.check_with_duckdb(cat)


def test_missing_user_folder_is_an_error(tmp_path):
    with pytest.raises(sig.SignatureError):
        sig.load([tmp_path / "nope"])


# -- matching on real-format lines, benign look-alikes included -----------------------------

BENIGN = {
    # vLLM V0 prints this whenever CUDA graphs are on
    "(WorkerDict pid=11) INFO 03-14 10:00:00 model_runner.py:1404] If out-of-memory error occurs during cudagraph capture, consider decreasing `gpu_memory_utilization` or switching to eager mode.": set(),
    # "out of memory" words inside a config dump
    "(TaskRunner pid=10)                                    'hint': 'CUDA out of memory. Tried to allocate',": set(),
    # a preemption warning is a performance finding, not a failure
    "(WorkerDict pid=11) WARNING 03-14 10:00:01 scheduler.py:1560] Sequence group 3 is preempted by PreemptionMode.RECOMPUTE mode because there is not enough KV cache space. total_num_cumulative_preemption=1": {"vllm_preemption"},
    # Ray's worker-exit boilerplate mentions the OOM killer as a *possible* cause
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some potential root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage.": {"actor_died_error"},
    # verl's pad-token fix-up
    "(TaskRunner pid=10) /opt/verl/verl/utils/tokenizer.py:30: UserWarning: tokenizer.pad_token_id is None. Now set to 2": {"verl_pad_token_fixup"},
    # vLLM's commit-hash warning and its follow-up line
    "(WorkerDict pid=11) /usr/lib/python3.10/site-packages/vllm/connections.py:8: RuntimeWarning: Failed to read commit hash:": {"vllm_commit_hash_warning"},
    "(WorkerDict pid=11) No module named 'vllm._version'": set(),
    # the raylet's disk warning without OutOfDiskError
    "(raylet) [2025-07-04 03:52:02,049 E 4411 4450] (raylet) file_system_monitor.cc:116: /tmp/ray/session_x is over 95% full, available space: 1.8 GB; capacity: 1787.32 GB. Object creation will fail if spilling is required.": {"ray_disk_usage_warning"},
    # Ray's OOM summary with zero kills
    "(raylet) [2025-02-14 07:56:05,601 E 6495 6495] (raylet) node_manager.cc:3069: 0 Workers (tasks / actors) killed due to memory pressure (OOM), 1 Workers crashed due to other reasons at node (ID: 39, IP: 10.0.0.1) over the last time period.": set(),
    # the source line a traceback shows is not the error it raises
    '    raise ValueError("No available memory for the cache blocks. "': set(),
    "(WorkerDict pid=11) node-1:11:11 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)": set(),
}

POSITIVE = {
    "(WorkerDict pid=12) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.11 GiB of which 1.0 GiB is free.": {"torch_cuda_oom"},
    "[E ProcessGroupNCCL.cpp:475] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=BROADCAST, Timeout(ms)=1800000) ran for 1800052 milliseconds before timing out.": {"nccl_watchdog_timeout"},
    "[Tue Mar 11 04:10:02 2025] NVRM: Xid (PCI:0000:c1:00): 79, pid=61234, name=python3, GPU has fallen off the bus.": {"nvrm_xid"},
    "Jul 12 19:19:21 node3 kernel: [811.02] Out of memory: Killed process 275043 (ray::WorkerDic) total-vm:12kB, anon-rss:1kB": {"kernel_oom_kill"},
    "(raylet) [2025-02-14 07:56:05,601 E 6495 6495] (raylet) node_manager.cc:3069: 2 Workers (tasks / actors) killed due to memory pressure (OOM), 0 Workers crashed due to other reasons at node (ID: 39, IP: 10.0.0.1) over the last time period.": {"ray_oom_summary"},
    "ray.exceptions.OutOfDiskError: Local disk is full": {"ray_out_of_disk"},
    "(WorkerDict pid=13) ImportError: cannot import name 'SamplerOutput' from 'vllm.sequence' (/usr/lib/python3.10/site-packages/vllm/sequence.py)": {"engine_import_error"},
}


@pytest.fixture(scope="module")
def matched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lines")
    lines = list(BENIGN) + list(POSITIVE)
    (folder / "mixed.log").write_text("\n".join(lines) + "\n")
    db = folder / "m.duckdb"
    pipeline.ingest([str(folder / "mixed.log")], str(db), workers=1)
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    cat = sig.load()
    df = matching.match(con, cat.rules)
    con.close()
    by_line: dict[int, set[str]] = {}
    for idx, line_no in zip(df["rule_idx"].to_list(), df["line_no"].to_list()):
        by_line.setdefault(line_no, set()).add(cat.rules[idx].id)
    return {text: by_line.get(i + 1, set()) for i, text in enumerate(lines)}


@pytest.mark.parametrize("text", list(BENIGN))
def test_benign_look_alikes_do_not_fire(matched, text):
    got = matched[text]
    assert got == BENIGN[text], f"{text[:80]!r}: matched {sorted(got)}"


@pytest.mark.parametrize("text", list(POSITIVE))
def test_real_lines_fire(matched, text):
    assert POSITIVE[text] <= matched[text], f"{text[:80]!r}: matched {sorted(matched[text])}"


# -- user rule folders ---------------------------------------------------------------------

USER_RULES = """
rules:
  - id: site_quota_exhausted
    title: our storage gateway refused a write
    class: disk_full
    role: cause
    weight: 0.9
    patterns: ['QuotaGate: write refused for volume \\S+']
    remediation: ["ask storage-admin for more quota on the checkpoint volume"]
  - id: training_finished
    class: healthy
    role: end
    patterns: ['^ALL DONE$']
"""


def test_user_rules_are_loaded_and_override(tmp_path):
    folder = _write_rules(tmp_path / "site", USER_RULES)
    cat = sig.load([folder])
    ids = {r.id: r for r in cat.rules}
    assert "site_quota_exhausted" in ids
    assert ids["training_finished"].patterns == ("^ALL DONE$",)  # replaced, not merged
    assert str(folder) in ids["site_quota_exhausted"].source


def test_user_rule_drives_diagnosis_and_cli(tmp_path):
    folder = _write_rules(tmp_path / "site", USER_RULES)
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text(
        "2025-01-01 10:00:00,000 INFO step 1 done\n"
        "2025-01-01 10:05:00,000 ERROR QuotaGate: write refused for volume ckpt-7\n"
        "Traceback (most recent call last):\n"
        '  File "train.py", line 9, in <module>\n'
        "OSError: write failed\n"
    )
    db = tmp_path / "r.duckdb"
    pipeline.ingest([str(run)], str(db), workers=1)
    without = dg.diagnose(db)
    assert without.root_causes[0].id != "disk_full"
    d = dg.diagnose(db, [str(folder)])
    top = d.root_causes[0]
    assert top.id == "disk_full"
    assert top.evidence[0].file == "train.log" and top.evidence[0].line == 2
    assert top.remediation[0] == "ask storage-admin for more quota on the checkpoint volume"
    r = CliRunner().invoke(app, ["signatures", "--json", "--signatures", str(folder)])
    assert r.exit_code == 0, r.output
    assert "site_quota_exhausted" in {x["id"] for x in json.loads(r.output)["rules"]}
    r = CliRunner().invoke(app, ["diagnose", "--db", str(db), "--json", "--signatures", str(folder)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["root_causes"][0]["id"] == "disk_full"


def test_bad_user_folder_makes_cli_fail(tmp_path):
    folder = _write_rules(tmp_path / "bad", "rules:\n  - id: x\n    class: nope\n    role: cause\n    patterns: ['abcd']\n")
    r = CliRunner().invoke(app, ["signatures", "--signatures", str(folder)])
    assert r.exit_code != 0
    assert "not a taxonomy class" in r.output


def test_signatures_command_lists_the_catalogue():
    r = CliRunner().invoke(app, ["signatures", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    classes = {x["class"] for x in doc["rules"]}
    assert {"oom_training", "nccl_timeout", "host_oom_ray", "healthy"} <= classes
    assert {"divergence", "entropy"} <= set(doc["metric_detectors"])
