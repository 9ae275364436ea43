"""Lines relayed by container tools (parsers/lines/containers.py: ``docker compose``,
``kubectl logs --prefix``) and by multi-node launchers (parsers/lines/launchers.py:
``mpirun --tag-output``, pdsh / DeepSpeed, ``srun --label``): the prefix is stripped and
names the line's node or rank, so that the headers and tracebacks behind it are read; and
the helpers that work relies on."""
from __future__ import annotations

import io

import polars as pl

from forensics.parsers.base import FileContext
from forensics.parsers.lines.common import apply_header, g
from forensics.parsers.text import inherit_from_event, parse_text


def _parse(text: str, path: str = "run.log"):
    ctx = FileContext(file_id=1, path=path, size=len(text), fmt="text")
    out: dict[str, list[pl.DataFrame]] = {}
    for name, frame in parse_text(io.BytesIO(text.encode()), ctx):
        out.setdefault(name, []).append(frame)
    return {k: pl.concat(v, how="vertical_relaxed") for k, v in out.items()}


COMPOSE = (
    "rollout-1  | [2025-03-28 09:14:24 TP0] Capture cuda graph begin. avail mem=7.96 GB\n"
    "trainer-1  | 2025-03-28 09:14:25,001 ERROR verl.trainer - rollout server not ready\n"
    "rollout-1  | Traceback (most recent call last):\n"
    "rollout-1  |   File \"/usr/local/lib/python3.11/site-packages/sglang/srt/model_executor/model_runner.py\", line 902, in init_cuda_graphs\n"
    "rollout-1  |     self.cuda_graph_runner = CudaGraphRunner(self)\n"
    "rollout-1  | RuntimeError: Triton Error [CUDA]: an illegal instruction was encountered\n"
)


def test_compose_prefix_is_stripped_and_names_the_node():
    t = _parse(COMPOSE)
    lines = t["lines"].sort("line_no")
    assert lines["node"].to_list() == ["rollout-1", "trainer-1", "rollout-1", "rollout-1", "rollout-1", "rollout-1"]
    assert lines["message"][0].startswith("Capture cuda graph begin")  # the SGLang header was read behind it
    assert lines["level"][1] == "ERROR"
    ev = t["fatal_events"].row(0, named=True)
    assert ev["exc_type"] == "RuntimeError" and ev["line_no"] == 3 and ev["exc_line"] == 6
    assert [f["function"] for f in ev["frames"]] == ["init_cuda_graphs"]


def _lines_and_traceback(text: str, want: tuple[str, int, int, list[str]]) -> pl.DataFrame:
    """The lines of ``text`` (by line number), after checking that its one traceback was read
    behind the prefix: (exception type, first line, exception line, frame functions)."""
    t = _parse(text)
    ev = t["fatal_events"].row(0, named=True)
    assert (ev["exc_type"], ev["line_no"], ev["exc_line"], [f["function"] for f in ev["frames"]]) == want
    return t["lines"].sort("line_no")


def test_cri_log_prefix_is_stripped_and_the_header_behind_it_read():
    """The kubelet's CRI log files: `<RFC 3339 time> stdout|stderr P|F message`."""
    text = ("2025-06-03T11:20:41.102331577+08:00 stdout F [2025-06-03 11:20:41 TP1] Scheduler hit an exception: Traceback (most recent call last):\n"
            "2025-06-03T11:20:41.102337014+08:00 stdout F   File \"/opt/sglang/srt/managers/scheduler.py\", line 901, in event_loop_normal\n"
            "2025-06-03T11:20:41.102339950+08:00 stdout F     result = self.run_batch(batch)\n"
            "2025-06-03T11:20:41.102342116+08:00 stderr F RuntimeError: boom\n")
    lines = _lines_and_traceback(text, ("RuntimeError", 1, 4, ["event_loop_normal"]))
    assert lines["message"][0].startswith("Scheduler hit an exception")  # SGLang's header was read behind it
    assert lines["header"][0] == "sglang"


def test_docker_timestamps_and_a_raw_streams_frame_residue_are_stripped():
    """`docker logs --timestamps`, read without demultiplexing (what is left of each 8-byte
    frame header: control bytes and one printable byte), behind a wrapper's service tag;
    the traceback behind it is read. A file where few lines start so keeps them."""
    text = ("[trainer] \x01\x00\x00\x00\x00\x00\x00B2025-05-23T16:49:12.290114123Z Traceback (most recent call last):\n"
            "[trainer] o2025-05-23T16:49:12.290129429Z   File \"/app/rl/trainer.py\", line 335, in train\n"
            "[trainer] 12025-05-23T16:49:12.290132874Z     self.step(batch)\n"
            "[trainer] \ufffd2025-05-23T16:49:12.290135653Z ValueError: empty batch\n")
    lines = _lines_and_traceback(text, ("ValueError", 1, 4, ["train"]))
    assert lines["node"].to_list() == ["trainer"] * 4
    assert lines["message"][0] == "Traceback (most recent call last):" and lines["message"][3] == "ValueError: empty batch"
    assert str(lines["ts"][0]) == "2025-05-23 16:49:12.290114"  # the daemon's time, read behind the residue
    tagged_once = "[trainer] 2025-05-23T16:49:12.290114123Z started\n" + "".join(f"step {i} loss=0.{i}\n" for i in range(5))
    assert _parse(tagged_once)["lines"].sort("line_no")["message"][0].startswith("[trainer] ")


def test_skypilot_prefix_names_the_node_not_a_process_or_rank():
    """SkyPilot's `(worker1, rank=1, pid=N, ip=A) `: the node's rank and the job shell's pid,
    so only the node is kept; a Ray prefix behind it is read (older releases name the
    instance first)."""
    text = ("(head, rank=0, pid=2514) step:11 - actor/pg_loss:0.21\n"
            "(worker1, rank=1, pid=2466, ip=10.0.0.5) Traceback (most recent call last):\n"
            "(worker1, rank=1, pid=2466, ip=10.0.0.5)   File \"/app/verl/workers/actor/dp_actor.py\", line 399, in update_policy\n"
            "(worker1, rank=1, pid=2466, ip=10.0.0.5)     loss.backward()\n"
            "(worker1, rank=1, pid=2466, ip=10.0.0.5) torch.OutOfMemoryError: CUDA out of memory.\n"
            "(node-2, head, rank=0, pid=2514) (TaskRunner pid=3011) step:12 - actor/pg_loss:0.20\n")
    lines = _lines_and_traceback(text, ("torch.OutOfMemoryError", 2, 5, ["update_policy"]))
    assert lines["node"].to_list() == ["head"] + ["10.0.0.5"] * 4 + ["node-2"]
    assert lines["rank"].is_null().all() and lines["pid"][:5].is_null().all()
    assert (lines["actor"][5], lines["pid"][5], lines["message"][5]) == ("TaskRunner", 3011, "step:12 - actor/pg_loss:0.20")


def test_the_frame_a_log_viewer_draws_is_removed():
    """`│ <message padded to the pane's width> │` on every line: the vLLM header inside is read."""
    text = "".join(f"│ {m}".ljust(90) + "│\n" for m in (
        "ERROR 09-27 06:46:46 engine.py:157] RuntimeError: boom",
        "ERROR 09-27 06:46:46 engine.py:157]",
        "INFO 09-27 06:46:47 engine.py:301] shutting down"))
    lines = _parse(text)["lines"].sort("line_no")
    assert lines["header"].to_list() == ["vllm", "vllm", "vllm"]
    assert lines["message"].to_list() == ["RuntimeError: boom", "", "shutting down"]


def test_kubectl_prefix():
    text = ("[pod/verl-worker-0/main] 2025-03-28 09:14:25,001 - verl.trainer - INFO - step 1\n"
            "[pod/verl-worker-1/main] 2025-03-28 09:14:25,002 - verl.trainer - WARNING - slow\n")
    lines = _parse(text)["lines"].sort("line_no")
    assert lines["node"].to_list() == ["verl-worker-0", "verl-worker-1"]
    assert lines["level"].to_list() == ["INFO", "WARNING"]
    assert lines["message"].to_list() == ["step 1", "slow"]


def test_a_prefix_on_few_lines_is_text():
    # a table printed by a program: one row looks like a compose prefix, most do not
    text = "name | value\nrow-1 | 3\nlr | 0.1\nbatch | 64\nepochs | 2\n"
    lines = _parse(text)["lines"].sort("line_no")
    assert lines["message"][1] == "row-1 | 3" and lines["node"].is_null().all()


def test_mpi_tag_output_names_the_rank():
    text = ("[1,1]<stderr>:Traceback (most recent call last):\n"
            "[1,1]<stderr>:  File \"/work/train.py\", line 88, in <module>\n"
            "[1,1]<stderr>:    out = model(batch)\n"
            "[1,1]<stderr>:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.\n"
            "[1,0]<stdout>:step 10 loss 1.23\n")
    t = _parse(text)
    lines = t["lines"].sort("line_no")
    assert lines["rank"].to_list() == [1, 1, 1, 1, 0]
    assert lines["message"][4] == "step 10 loss 1.23"
    ev = t["fatal_events"].row(0, named=True)
    assert ev["exc_type"] == "torch.OutOfMemoryError" and ev["exc_line"] == 4


def test_pdsh_host_prefix_reveals_the_rank_prefix_behind_it():
    text = ("worker-1: [2025-04-01 10:00:00,010] [INFO] [launch.py:256:main] process 4413 spawned\n"
            "worker-0: [rank0]:[E401 10:30:00.000000000 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=20, OpType=ALLREDUCE) ran for 1800011 milliseconds\n"
            "10.0.0.7: Traceback (most recent call last):\n"
            "10.0.0.7:   File \"/x/train.py\", line 3, in <module>\n"
            "10.0.0.7: KeyError: 'prompt'\n")
    lines = _parse(text)["lines"].sort("line_no")
    assert lines["node"].to_list() == ["worker-1", "worker-0", "10.0.0.7", "10.0.0.7", "10.0.0.7"]
    assert lines["rank"][1] == 0 and lines["level"][1] == "ERROR"
    assert lines["message"][4] == "KeyError: 'prompt'"


def test_a_word_and_colon_is_not_a_host():
    # exception and level words hold no digit: never a launcher's host name
    text = ("ValueError: bad\nINFO: started\nvllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue\n"
            "vllm.v1.engine.exceptions.EngineDeadError: again\n")
    lines = _parse(text)["lines"].sort("line_no")
    assert lines["node"].is_null().all() and lines["message"][0] == "ValueError: bad"
    assert lines["message"][2].startswith("vllm.v1.engine.exceptions.EngineDeadError: ")


def test_apply_header_without_conditions_reads_every_row():
    # regression: with only_unset=False and no prefilter the condition was one literal,
    # whose arg_where gave one index, and only the first row was read
    df = pl.DataFrame({"message": ["a-1 | x", "b-2 | y", "c-3 | z"], "header": [None, "pylog", None],
                       "node": [None, None, None]}, schema_overrides={"header": pl.String, "node": pl.String})
    out = apply_header(df, r"^(?P<h>(?P<svc>\w-\d) \| )", None, {"node": g("svc")}, only_unset=False)
    assert out["node"].to_list() == ["a-1", "b-2", "c-3"]
    assert out["message"].to_list() == ["x", "y", "z"]


def test_lines_of_an_event_take_its_writer():
    df = pl.DataFrame({
        "file_id": [1, 1, 1, 1, 2],
        "line_no": [1, 2, 3, 4, 1],
        "event_line": [None, 2, 2, 2, 1],
        "rank": [None, 3, None, 4, None],
        "local_rank": [None] * 5, "pid": [None, 77, None, None, None],
        "actor": [None] * 5, "node": [None, "n1", None, None, None],
    }, schema_overrides={"rank": pl.Int64, "local_rank": pl.Int64, "pid": pl.Int64, "actor": pl.String, "node": pl.String})
    out = inherit_from_event(df)
    assert out["rank"].to_list() == [None, 3, 3, 4, None]  # a line's own rank wins
    assert out["pid"].to_list() == [None, 77, 77, 77, None]
    assert out["node"].to_list() == [None, "n1", "n1", "n1", None]  # another file's event is its own
    assert out.columns == df.columns and out["line_no"].to_list() == df["line_no"].to_list()


# vLLM's worker prefixes: a worker with its executor rank (`(VllmWorker rank=1 pid=N)`), and
# an engine core inside a Ray actor, whose lines Ray copies behind the actor's prefix
VLLM_WORKERS = (
    "(VllmWorker rank=1 pid=40117) ERROR 10-02 14:20:05 [multiproc_executor.py:527] WorkerProc hit an exception.\n"
    "(RolloutServer pid=20877) (EngineCore_DP0 pid=21190) ERROR 09-14 07:42:19 [core.py:842] Invocation of collective_rpc method failed\n"
    "(RolloutServer pid=20877) (Worker_TP1 pid=21305) ERROR 09-14 07:42:19 [multiproc_executor.py:932] WorkerProc hit an exception.\n"
)


def test_vllm_worker_prefixes_name_the_inner_process_and_no_global_rank():
    lines = _parse(VLLM_WORKERS)["lines"].sort("line_no")
    assert lines["pid"].to_list() == [40117, 21190, 21305]
    assert lines["actor"].to_list() == ["VllmWorker", "EngineCore_DP0", "Worker_TP1"]
    assert lines["level"].to_list() == ["ERROR", "ERROR", "ERROR"]  # the vLLM header behind the prefixes was read
    # an executor rank or a TP index is the worker's place in one engine, not a training rank
    assert lines["rank"].to_list() == [None, None, None]


def test_an_actor_named_by_its_repr():
    """Ray names an actor whose class defines __repr__ by that repr in the prefix; a
    framework's empty field after the pid is part of the prefix too."""
    text = ("(Rollout(index=3) pid=5120) Traceback (most recent call last):\n"
            "(InferWorker(infer-1) pid=7714, ) RuntimeError: boom\n"
            "(Rollout(index=3) pid=5120, ip=10.0.0.7) done\n")
    lines = _parse(text)["lines"].sort("line_no")
    assert lines["actor"].to_list() == ["Rollout(index=3)", "InferWorker(infer-1)", "Rollout(index=3)"]
    assert lines["pid"].to_list() == [5120, 7714, 5120]
    assert lines["message"].to_list() == ["Traceback (most recent call last):", "RuntimeError: boom", "done"]
    assert lines["node"][2] == "10.0.0.7"


def test_colour_codes_that_lost_their_escape_byte_are_part_of_the_prefix():
    """A terminal paste may keep `[36m` / `[0m` without ESC around Ray's prefix."""
    text = ("[36m(WorkerDict pid=12)[0m Traceback (most recent call last):\n"
            "[36m(WorkerDict pid=12, ip=10.0.0.3)[0m RuntimeError: boom\n"
            "[33m(raylet)[0m A worker died or was killed while executing a task\n")
    lines = _parse(text)["lines"].sort("line_no")
    assert lines["actor"].to_list() == ["WorkerDict", "WorkerDict", "raylet"]
    assert lines["message"][1] == "RuntimeError: boom" and lines["node"][1] == "10.0.0.3"


def test_lightnings_rank_prefix_gives_the_rank():
    # PyTorch Lightning's rank-prefixed messages (`[rank: N] `), beside torch's own `[rankN]:`
    text = "[rank: 0] Seed set to 42\n[rank: 3] Seed set to 42\n[rank3]:[W401 10:00:00.000000000 socket.cpp:752] c10d warning\n[rank 3] is not a prefix\n[rank3] nor this\n"
    lines = _parse(text)["lines"].sort("line_no")
    assert lines["rank"].to_list()[:3] == [0, 3, 3] and lines["message"][:2].to_list() == ["Seed set to 42"] * 2
    assert lines["rank"][3:].to_list() == [None, None] and lines["message"][3:].to_list() == ["[rank 3] is not a prefix", "[rank3] nor this"]


def test_metaflow_task_prefix_is_stripped_and_the_header_behind_it_read():
    """Metaflow's task log: `<date> <time.ms> [run/step/task (pid N)] ` and, on AWS Batch,
    `[<job uuid>] `: the time is kept, the traceback and the program's header behind it read."""
    job = "[5f2d77a1-0c3e-4b8e-9d41-6a0e2b9c1f08] "
    pre = "2024-11-05 21:14:03.412 [4312/finetune/9071 (pid 5120)] "
    text = (pre + job + "2024-11-05 21:14:03 ERROR [trainer] checkpoint failed\n"
            + pre + job + "Traceback (most recent call last):\n"
            + pre + job + "  File \"/srv/pkg/torch/serialization.py\", line 650, in save\n"
            + pre + job + "    _save(obj, opened_zipfile, pickle_module, pickle_protocol)\n"
            + pre + job + "OSError: [Errno 28] No space left on device\n"
            + "2024-11-05 21:14:04.001 [4312/finetune/9071 (pid 5120)] Task failed.\n")
    lines = _lines_and_traceback(text, ("OSError", 2, 5, ["save"]))
    assert lines["level"][0] == "ERROR" and lines["message"][0].endswith("checkpoint failed")
    assert lines["message"][4] == "OSError: [Errno 28] No space left on device"
    assert lines["message"][5] == "Task failed." and lines["ts"][5] is not None


def test_a_nemo_rl_worker_repr_gives_the_global_rank():
    """NeMo-RL's workers print `Class[rank=N]` as their repr, which Ray puts in the prefix
    (`(MegatronPolicyWorker[rank=8] pid=N, ip=A)`): N is the worker's global rank."""
    text = ("(PolicyWorkerV2[rank=5] pid=91011, ip=10.4.0.9)   File \"/srv/rl/train.py\", line 126 in model_forward\n"
            "(PolicyWorkerV2 pid=91011) Initializing PolicyWorkerV2\n")
    lines = _parse(text)["lines"].sort("line_no")
    assert lines["actor"].to_list() == ["PolicyWorkerV2", "PolicyWorkerV2"]
    assert lines["pid"].to_list() == [91011, 91011] and lines["node"][0] == "10.4.0.9"
    assert lines["rank"][0] == 5
    assert lines["message"][0].startswith('  File "/srv/rl/train.py"')
