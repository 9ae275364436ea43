"""placement._NearBodies (the traceback body that tells a hit's phase when its own does not)
gives what the plain definition gives: sort every body of the process by nearness and take
the first whose frames imply a phase. Checked on random hits against that definition."""
import random
from types import SimpleNamespace

from forensics.diagnosis.placement import NEAR_LINES, _NearBodies


class _Ctx:
    def phase_of(self, text, frames_only=False):
        return None if text is None or text.startswith("none") else text.split(":")[0]


def _by_sorting(h, hits, ctx):
    """The definition, as place() first wrote it: a sort of every candidate for every hit."""
    procs = [o for o in hits if o.body and o.proc is not None and o.proc == h.proc]

    def near(o):
        return (o.rule.id != h.rule.id, o.file_id != h.file_id, abs((o.line_no or 0) - (h.line_no or 0)))
    for o in sorted(procs, key=near):
        if o.rule.id != h.rule.id and (o.file_id != h.file_id or abs((o.line_no or 0) - (h.line_no or 0)) > NEAR_LINES):
            continue
        ph = ctx.phase_of(o.body, frames_only=True)
        if ph:
            return ph
    return None


def _after_by_sorting(h, hits, ctx):
    for o in sorted((o for o in hits if o.body and o.file_id == h.file_id), key=lambda o: o.line_no or 0):
        if 0 < (o.line_no or 0) - (h.line_no or 0) <= NEAR_LINES:
            ph = ctx.phase_of(o.body, frames_only=True)
            if ph:
                return ph
    return None


def test_near_bodies_equal_the_sorted_definition():
    rnd = random.Random(7)
    ctx = _Ctx()
    for trial in range(60):
        hits = []
        for i in range(rnd.randint(1, 80)):
            body = rnd.choice([None, "none", f"p{rnd.randint(0, 5)}:x{i}"])
            hits.append(SimpleNamespace(rule=SimpleNamespace(id=rnd.choice("abc")), file_id=rnd.randint(1, 3),
                                        line_no=rnd.choice([None, *range(1, 120, rnd.randint(1, 9))]),
                                        proc=rnd.choice([None, 10, 11]), body=body))
        index = _NearBodies(ctx, hits)
        for h in hits:
            if h.proc is not None:
                assert index.of_process(h) == _by_sorting(h, hits, ctx), (trial, h)
            assert index.after_in_file(h) == _after_by_sorting(h, hits, ctx), (trial, h)
