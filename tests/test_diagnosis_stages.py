"""The diagnosis' stages one at a time (forensics/diagnosis/): matching of fatal events,
the choice between generic and specific causes, one class per event, what gives way to
what, the evidence notes' conditions, the incomplete verdict. End-to-end bundles are in
test_diagnose.py; here each stage is fed small records."""
from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from forensics import catalogue as sig
from forensics.catalogue import ExceptionMatch, Rule
from forensics.diagnosis import explain, matching, selection
from forensics.diagnosis.model import Event, Hit

CAT = sig.load()


def _rule(rid="r", cls="oom_training", role="cause", weight=0.8, generic=False) -> Rule:
    return Rule(id=rid, cls=cls, role=role, patterns=(".",), keywords=(), keywords_ci=(), weight=weight, generic=generic)


def _hit(rule: Rule, line=10, event_line=None, ts=None, path="w.err", file_id=1, cls=None) -> Hit:
    h = Hit(rule=rule, file_id=file_id, path=path, fmt="text", line_no=line, ts=ts, ts_quality="full" if ts else None,
            level=None, header=None, actor=None, pid=None, node=None, rank=None, event_line=event_line, message="m")
    h.cls = cls or rule.cls
    return h


# -- matching: fatal events ------------------------------------------------------------

EVENT = {
    "kind": "python", "exc_type": "KeyError", "types": ["ray.exceptions.RayTaskError", "KeyError"],
    "wrapped_type": "KeyError", "message": "'prompt'", "outer_message": None, "chain": [],
    "package": "verl", "wrapper": "RayTaskError", "ray_method": "run", "ray_actor": "TaskRunner", "actor": None,
    "frames": [{"file": "/x/verl/utils/dataset/rl_dataset.py", "function": "_build_messages",
                "code": "messages: list = example.pop(self.prompt_key)", "package": "verl"}],
}


@pytest.mark.parametrize("m, fires", [
    (ExceptionMatch(type="^KeyError$"), True),
    (ExceptionMatch(type="^RayTaskError$"), True),  # short names of dotted types count
    (ExceptionMatch(not_type="^ray\\."), False),
    (ExceptionMatch(message="^'prompt'$"), True),
    (ExceptionMatch(raised_in=("vllm",)), False),
    (ExceptionMatch(frames="rl_dataset\\.py:_build_messages$"), True),
    (ExceptionMatch(frames="example\\.pop"), True),  # a frame's source line counts too
    (ExceptionMatch(kind=("native",)), False),
    (ExceptionMatch(method="^run$", actor="TaskRunner"), True),
    (ExceptionMatch(wrapper=("RayTaskError",)), True),
    (ExceptionMatch(not_wrapper=("RayTaskError",)), False),
    (ExceptionMatch(preceded_by="loading checkpoint"), False),  # nothing to ask
])
def test_event_matches(m, fires):
    assert matching.event_matches(m, EVENT) is fires


def test_preceded_by_asks_the_lines_before():
    m = ExceptionMatch(preceded_by="loading checkpoint")
    assert matching.event_matches(m, EVENT, lambda rx: rx == "loading checkpoint")
    assert not matching.event_matches(m, EVENT, lambda rx: False)


# -- selection ---------------------------------------------------------------------------

def test_a_generic_cause_gives_way_to_a_specific_one_on_the_same_event():
    generic = _hit(_rule("unexplained", "application_error", generic=True), line=12, event_line=3)
    specific = _hit(_rule("oom", "oom_training"), line=12, event_line=3)
    elsewhere = _hit(_rule("unexplained", "application_error", generic=True), line=40, event_line=30)
    kept = matching.drop_explained_generic([generic, specific, elsewhere])
    assert kept == [specific, elsewhere]


def test_one_class_per_event_keeps_the_heaviest_cause():
    crash = _hit(_rule("native", "ray_actor_died", weight=0.95), line=2, event_line=1)
    capture = _hit(_rule("capture", "cuda_graph", weight=0.97), line=1, event_line=1)
    other = _hit(_rule("native", "ray_actor_died", weight=0.95), line=50, event_line=45)
    assert selection.one_class_per_event([crash, capture, other]) == [capture, other]


def test_gives_way_to_an_earlier_network_failure():
    t = datetime(2025, 1, 1, 10, 0, 0)
    net = Event("nccl_network", [_hit(_rule("ib", "nccl_network", role="fallback", weight=0.45), ts=t)], "fallback")
    timeout = Event("nccl_timeout", [_hit(_rule("wd", "nccl_timeout", role="fallback", weight=0.6), ts=t + timedelta(minutes=30))], "fallback")

    class Ctx:
        causality = CAT.causality

    standing, gave = selection.give_way(Ctx, [net, timeout])
    assert standing == [net] and gave == [timeout]
    later_net = Event("nccl_network", [_hit(_rule("ib", "nccl_network", role="fallback"), ts=t + timedelta(hours=2))], "fallback")
    standing, gave = selection.give_way(Ctx, [later_net, timeout])
    assert gave == []  # a network error after the timeout explains nothing


def test_an_unstamped_line_is_ordered_at_the_next_stamp_of_its_file():
    t = datetime(2025, 1, 1, 10, 0, 0)
    first = _hit(_rule("ib", "nccl_network"), line=3)
    first.ts_hi = t  # the first stamp of the file comes after it
    later = _hit(_rule("wd", "weight_sync_timeout"), line=4, ts=t)
    a, b = Event("nccl_network", [first], "cause"), Event("weight_sync_timeout", [later], "cause")
    import functools

    assert sorted([b, a], key=functools.cmp_to_key(selection.compare))[0] is a


# -- explain ---------------------------------------------------------------------------

def test_evidence_note_conditions():
    class Facts:
        has_nccl_lines = False
        formats = {"driver": 1}
        dedup_lines = 3
        config = type("C", (), {"get": lambda self, k: True})()

    root = Event("nccl_timeout", [_hit(_rule(role="fallback"))], "fallback")
    assert explain._holds("no_nccl_lines", True, Facts, root)
    assert explain._holds("missing_format", "kernel", Facts, root)
    assert not explain._holds("missing_format", "driver", Facts, root)
    assert explain._holds("dedup_lines", True, Facts, root)
    assert explain._holds("root_role", "fallback", Facts, root)
    assert explain._holds("config", {"actor_rollout_ref.rollout.disable_log_stats": True}, Facts, root)
    with pytest.raises(ValueError):
        explain._holds("no_such_condition", True, Facts, root)


def test_causality_section_names_only_known_rules_and_classes(tmp_path):
    (tmp_path / "c.yaml").write_text("causality:\n  collective_timeouts: [no_such_rule]\n")
    with pytest.raises(sig.SignatureError, match="no_such_rule"):
        sig.load([tmp_path])
    (tmp_path / "c.yaml").write_text("causality:\n  unexplained: not_a_class\n")
    with pytest.raises(sig.SignatureError, match="not_a_class"):
        sig.load([tmp_path])


def test_a_user_folder_replaces_one_causality_key(tmp_path):
    (tmp_path / "c.yaml").write_text("causality:\n  shutdown_noise: [nccl_timeout]\n")
    cat = sig.load([tmp_path])
    assert cat.causality.shutdown_noise == ("nccl_timeout",)
    assert cat.causality.unexplained == CAT.causality.unexplained  # the other keys stay
