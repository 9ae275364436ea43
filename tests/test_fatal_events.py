"""Fatal events (parsers/fatal_events.py): tracebacks, wrappers, native crashes and fatal
records read from text as structured rows. Every snippet is written here, in the shapes the
software prints (sources of the shapes: tests/fixtures/SOURCES.md)."""
from __future__ import annotations

import io
import textwrap

import polars as pl
import pytest

from forensics.parsers.base import FileContext
from forensics.parsers.fatal_events import FATAL_EVENTS, frame_package
from forensics.parsers.text import parse_text


def _parse(text: str, name: str = "driver.log", fmt: str = "text") -> tuple[pl.DataFrame, pl.DataFrame]:
    text = textwrap.dedent(text).lstrip("\n")
    ctx = FileContext(file_id=1, path=name, size=len(text), fmt=fmt)
    out: dict[str, list] = {}
    for table, frame in parse_text(io.BytesIO(text.encode()), ctx):
        out.setdefault(table, []).append(frame)
    lines = pl.concat(out["lines"])
    events = pl.concat(out[FATAL_EVENTS.name]) if FATAL_EVENTS.name in out else FATAL_EVENTS.empty()
    return lines, events


def _one(text: str, **kw) -> dict:
    _, ev = _parse(text, **kw)
    assert ev.height == 1, ev
    return ev.row(0, named=True)


def test_plain_traceback_with_frames_and_packages():
    e = _one('''
        step 3 started
        Traceback (most recent call last):
          File "/home/me/rl/my_reward.py", line 17, in compute_score
            return table[answer]
                   ~~~~~^^^^^^^^
          File "/opt/env/lib/python3.11/site-packages/verl/workers/reward_manager/naive.py", line 88, in __call__
            score = self.compute_score(data_source=src, solution_str=s)
        KeyError: 'gsm8k'
        step 4 started
        ''')
    assert (e["line_no"], e["exc_line"], e["last_line"]) == (2, 8, 8)
    assert (e["kind"], e["exc_type"], e["exc_name"], e["message"]) == ("python", "KeyError", "KeyError", "'gsm8k'")
    assert [(f["function"], f["package"]) for f in e["frames"]] == [("compute_score", "user"), ("__call__", "verl")]
    assert e["frames"][0]["code"] == "return table[answer]"
    assert e["package"] == "verl" and e["user_frame"] == "my_reward.py:17 in compute_score"
    assert not e["cut_off"]


def test_event_line_covers_the_event_only():
    lines, _ = _parse('''
        before
        Traceback (most recent call last):
          File "a.py", line 1, in <module>
            f()
        ValueError: bad
        after
        ''')
    assert lines.select("line_no", "event_line").rows() == [(1, None), (2, 2), (3, 2), (4, 2), (5, 2), (6, None)]


def test_chained_exceptions_root_is_the_first():
    e = _one('''
        Traceback (most recent call last):
          File "/srv/app/trainer.py", line 40, in init_workers
            self.build(cfg.actor.optim.optimizer)
        omegaconf.errors.ConfigAttributeError: Key 'optimizer' is not in struct
            full_key: actor.optim.optimizer
            object_type=dict

        The above exception was the direct cause of the following exception:

        Traceback (most recent call last):
          File "/srv/app/main.py", line 9, in main
            trainer.init_workers()
        RuntimeError: Failed to initialize trainer
        ''')
    assert e["exc_type"] == "omegaconf.errors.ConfigAttributeError" and e["exc_line"] == 4
    assert e["message"].startswith("Key 'optimizer' is not in struct\nfull_key: actor.optim.optimizer")
    assert (e["outer_type"], e["outer_message"]) == ("RuntimeError", "Failed to initialize trainer")
    assert [c["relation"] for c in e["chain"]] == [None, "cause"]
    assert e["types"] == ["omegaconf.errors.ConfigAttributeError", "RuntimeError"]
    assert e["last_line"] == 13


def test_chain_seen_only_from_its_first_exception_line():
    """A paste that starts at the first exception of a chain: no traceback header before it."""
    e = _one('''
        KeyError: 'optimizer'

        During handling of the above exception, another exception occurred:

        ray::train_agents()
          File "/x/trainer.py", line 266, in init_workers
            raise RuntimeError("init failed") from e
        RuntimeError: init failed
        ''')
    assert (e["line_no"], e["exc_line"], e["exc_type"], e["outer_type"]) == (1, 1, "KeyError", "RuntimeError")
    assert e["ray_method"] == "train_agents" and e["chain"][1]["relation"] == "context"


def test_cancellation_the_chain_carries_on_from_is_not_the_root():
    """asyncio ends a wait by cancelling the awaited task: the CancelledError a chain carries on
    from is the mechanism, the exception it led to is the failure (here cut off)."""
    e = _one('''
        Traceback (most recent call last):
          File "/opt/py/lib/python3.11/asyncio/locks.py", line 212, in wait
            await fut
        asyncio.exceptions.CancelledError

        The above exception was the direct cause of the following exception:

        Traceback (most recent call last):
          File "/opt/py/lib/python3.11/site-packages/tracker/client.py", line 88, in wait_reply
            await asyncio.wait_for(evt.wait(), timeout=timeout)
          File "/opt/py
        ''')
    assert (e["exc_type"], e["cut_off"]) == ("unknown", True)
    assert "asyncio.exceptions.CancelledError" not in e["types"]
    e = _one('''
        Traceback (most recent call last):
          File "/opt/py/lib/python3.11/asyncio/tasks.py", line 500, in wait_for
            return fut.result()
        asyncio.exceptions.CancelledError

        The above exception was the direct cause of the following exception:

        Traceback (most recent call last):
          File "/srv/judge/client.py", line 31, in score
            return await asyncio.wait_for(self.call(req), timeout=30)
        TimeoutError
        ''')
    assert e["exc_type"] == "TimeoutError" and e["types"] == ["TimeoutError"]
    # a cancellation on its own (a task cancelled at shutdown) stays what it is
    e = _one('''
        Traceback (most recent call last):
          File "/opt/py/lib/python3.11/asyncio/tasks.py", line 500, in wait_for
            return fut.result()
        asyncio.exceptions.CancelledError
        ''')
    assert e["exc_type"] == "asyncio.exceptions.CancelledError"


def test_ray_task_error_remote_traceback_and_wrapped_type():
    e = _one('''
        Traceback (most recent call last):
          File "/opt/verl/trainer/main_ppo.py", line 64, in main
            ray.get(runner.run.remote(config))
        ray.exceptions.RayTaskError(KeyError): ray::TaskRunner.run() (pid=2211, ip=10.1.2.3, actor_id=ab12, repr=<main_ppo.TaskRunner object at 0x7f>)
          File "/opt/verl/trainer/ppo/ray_trainer.py", line 910, in fit
            val_metrics = self._validate()
          File "/opt/verl/workers/reward_manager/naive.py", line 70, in __call__
            ground_truth = data_item.non_tensor_batch["reward_model"]["ground_truth"]
        KeyError: 'reward_model'
        ''')
    assert (e["wrapper"], e["wrapped_type"], e["exc_type"], e["message"]) == ("RayTaskError", "KeyError", "KeyError", "'reward_model'")
    assert (e["ray_actor"], e["ray_method"], e["ray_pid"], e["ray_ip"]) == ("TaskRunner", "run", 2211, "10.1.2.3")
    assert e["exc_line"] == 9  # the remote exception's own line, not the wrapper's
    assert [f["function"] for f in e["frames"] if f["part"] == 1] == ["fit", "__call__"]
    assert e["package"] == "verl"


def test_ray_wrapper_without_its_remote_part_keeps_the_wrapped_type():
    e = _one('''
          File "/usr/lib/python3.10/asyncio/tasks.py", line 650, in _wrap_awaitable
            return (yield from awaitable.__await__())
        ray.exceptions.RayTaskError(OutOfMemoryError): ray::LLMActor.backload_to_gpu() (pid=11992, ip=10.14.9.9, actor_id=94ea
        ''')
    assert (e["exc_type"], e["wrapper"], e["ray_actor"], e["ray_method"]) == ("OutOfMemoryError", "RayTaskError", "LLMActor", "backload_to_gpu")
    assert e["line_no"] == 1 and e["exc_line"] == 3  # a traceback tail: it starts at a frame line; no remote part: the wrapper's line


def test_frames_whose_indentation_was_lost():
    e = _one('''
        Traceback (most recent call last):
        File "/w/train_grpo.py", line 130, in main
        ray.get(main_task.remote(config))
        File "/w/venv/lib/python3.11/site-packages/ray/_private/worker.py", line 919, in get_objects
        raise value.as_instanceof_cause()
        ray.exceptions.RayTaskError(KeyError): ray::main_task() (pid=13, ip=172.20.0.2)
        File "/w/trainers/grpo_trainer.py", line 104, in _score_output
        correct = self.scorer(answer)
        KeyError: 'boxnet'
        ''')
    assert [f["code"] for f in e["frames"]][:2] == ["ray.get(main_task.remote(config))", "raise value.as_instanceof_cause()"]
    assert (e["exc_type"], e["message"], e["exc_line"]) == ("KeyError", "'boxnet'", 9)
    assert e["user_frame"] == "grpo_trainer.py:104 in _score_output"


def test_lost_indentation_call_lines_and_markers_under_a_ray_task():
    # a source line shaped like `name(arg)` is code, not an exception; Python 3.11's `^^^`
    # markers under a RayTaskError's task line do not end the event
    e = _one('''
        Traceback (most recent call last):
        File "/w/rl/launch.py", line 20, in main
        train(cfg)
        File "/w/venv/lib/python3.12/site-packages/ray/_private/worker.py", line 968, in get_objects
        raise value.as_instanceof_cause()
        ray.exceptions.RayTaskError(ValueError): ray::Runner.run() (pid=41, ip=10.0.0.5)
        ^^^^^^^^^^^^^^^^^^^^^^^
        File "/w/rl/scoring.py", line 33, in score
        raise ValueError(f"no scorer for {name}")
        ValueError: no scorer for puzzles
        ''')
    assert [f["code"] for f in e["frames"]][0] == "train(cfg)"
    assert (e["exc_type"], e["message"], e["exc_line"], e["wrapper"]) == ("ValueError", "no scorer for puzzles", 10, "RayTaskError")


def test_traceback_pasted_with_a_margin():
    # every line indented by one space: the exception line is at the header's indentation
    e = _one('''
        building the engine
         Traceback (most recent call last):
           File "/w/run.py", line 12, in <module>
             main()
           File "/w/venv/lib/python3.11/site-packages/vllm/config.py", line 2055, in _verify_args
             raise ValueError(
         ValueError: max_num_batched_tokens (2048) is smaller than max_model_len (8192).
        ''')
    assert (e["exc_type"], e["exc_line"], e["cut_off"]) == ("ValueError", 7, False)
    assert [f["code"] for f in e["frames"]] == ["main()", "raise ValueError("]


def test_prefixed_streams_are_followed_apart():
    """Two workers' tracebacks interleaved on the driver, and a driver line between them."""
    lines, ev = _parse('''
        (WorkerDict pid=11) Traceback (most recent call last):
        (WorkerDict pid=22) Traceback (most recent call last):
        (WorkerDict pid=11)   File "/x/fsdp_workers.py", line 5, in update_actor
        Training Progress:  40%|####      | 4/10 [00:10<00:15]
        (WorkerDict pid=22)   File "/x/fsdp_workers.py", line 9, in generate_sequences
        (WorkerDict pid=11)     loss.backward()
        (WorkerDict pid=22)     out = self.engine.generate(p)
        (WorkerDict pid=11) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB
        (WorkerDict pid=22) RuntimeError: CUDA error: an illegal memory access was encountered
        ''', fmt="driver")
    rows = {r["pid"]: r for r in ev.iter_rows(named=True)}
    assert set(rows) == {11, 22}
    assert rows[11]["exc_type"] == "torch.OutOfMemoryError" and rows[11]["frames"][0]["function"] == "update_actor"
    assert rows[22]["exc_type"] == "RuntimeError" and rows[22]["exc_line"] == 9
    assert lines.filter(pl.col("line_no") == 4)["event_line"][0] is None  # the driver's progress bar is no part of either


def test_rank_prefixed_traceback_and_other_records_between_frames():
    e = _one('''
        [default0]:Traceback (most recent call last):
        [default0]:  File "/home/rl/train.py", line 155, in main
        [default0]:    dist.init_process_group(backend)
        [default0]:
        [default0]:host:15:15 [0] NCCL INFO init.cc:126 -> 5
        [default0]:  File "/env/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 1710, in init_process_group
        [default0]:    raise DistBackendError(msg)
        [default0]:torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3410, invalid usage
        ''', fmt="torchrun")
    assert e["exc_type"] == "torch.distributed.DistBackendError" and len(e["frames"]) == 2 and e["last_line"] == 8


def test_vllm_headed_traceback_lines():
    e = _one('''
        (EngineCore pid=47) ERROR 11-30 01:06:00 [core.py:1510] EngineCore failed to start.
        (EngineCore pid=47) ERROR 11-30 01:06:00 [core.py:1510] Traceback (most recent call last):
        (EngineCore pid=47) ERROR 11-30 01:06:00 [core.py:1510]   File "/env/site-packages/vllm/v1/engine/core.py", line 326, in _initialize_kv_caches
        (EngineCore pid=47) ERROR 11-30 01:06:00 [core.py:1510]     kv_cache_configs = get_kv_cache_configs(
        (EngineCore pid=47) ERROR 11-30 01:06:00 [core.py:1510] ValueError: To serve at least one request ... larger than the available KV cache memory
        (EngineCore pid=47) ERROR 11-30 01:06:02 [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly
        ''', fmt="driver")
    assert (e["line_no"], e["exc_line"], e["last_line"], e["exc_type"], e["package"]) == (2, 5, 5, "ValueError", "vllm")


def test_native_crash_signal_and_faulthandler_stack():
    e = _one('''
        (RayWorkerWrapper pid=240)     @     0x7f1bc25d8090   36407536  (unknown)
        (RayWorkerWrapper pid=240) [2024-07-25 10:46:00,050 E 240 240] logging.cc:440: *** SIGSEGV received at time=1721904360 on cpu 14 ***
        (RayWorkerWrapper pid=240) [2024-07-25 10:46:00,050 E 240 240] logging.cc:440: PC: @     0x7f17f832d44a  (unknown)  someSymbol()
        (RayWorkerWrapper pid=240) Fatal Python error: Segmentation fault
        (RayWorkerWrapper pid=240)
        (RayWorkerWrapper pid=240) Stack (most recent call first):
        (RayWorkerWrapper pid=240)   File "/env/dist-packages/vllm/distributed/pynccl_wrapper.py", line 257 in ncclAllReduce
        (RayWorkerWrapper pid=240)   File "/env/dist-packages/vllm/worker/model_runner.py", line 99 in execute_model
        ''', fmt="driver")
    assert (e["kind"], e["signal"], e["exc_type"], e["line_no"], e["exc_line"]) == ("native", "SIGSEGV", "Segmentation fault", 1, 2)
    # faulthandler prints the innermost frame first: stored outermost first
    assert [f["function"] for f in e["frames"]] == ["execute_model", "ncclAllReduce"]
    assert e["package"] == "vllm"


def test_cpp_terminate_and_fatal_record_with_stack():
    _, ev = _parse('''
        terminate called after throwing an instance of 'c10::DistBackendError'
          what():  [PG ID 0 PG GUID 0 Rank 1] Process group watchdog thread terminated with exception
        Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:635 (most recent call first):
        frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f in /x/libc10.so)
        some unrelated line
        [2022-02-16 12:46:52,789 C 149 149] node_manager.cc:170: This node has been marked as dead.
        *** StackTrace Information ***
            ray::RayLog::~RayLog()
            main
        ''', name="raylet.out", fmt="ray_raylet")
    a, b = ev.iter_rows(named=True)
    assert (a["kind"], a["exc_type"], a["exc_name"], a["line_no"], a["last_line"]) == ("cpp", "c10::DistBackendError", "DistBackendError", 1, 4)
    assert a["message"].startswith("[PG ID 0 PG GUID 0 Rank 1] Process group watchdog")
    assert (b["kind"], b["exc_type"], b["message"], b["line_no"], b["last_line"]) == ("fatal_log", "FATAL", "This node has been marked as dead.", 6, 9)


def test_debugger_report_lists_innermost_frame_first():
    e = _one('''
        Exception has occurred: KeyError       (note: full exception trace is shown but execution is paused at: main)
        'prompt'
          File "C:\\env\\Lib\\site-packages\\trl\\trainer\\grpo_trainer.py", line 519, in _prepare_inputs
            prompts = [x["prompt"] for x in inputs]
          File "C:\\work\\my_trainer.py", line 11, in training_step
            return super().training_step(model, inputs)
        ''')
    assert (e["wrapper"], e["exc_type"], e["message"]) == ("debugger", "KeyError", "'prompt'")
    assert [f["function"] for f in e["frames"]] == ["training_step", "_prepare_inputs"]
    assert e["package"] == "trl" and e["user_frame"] == "my_trainer.py:11 in training_step"


def test_hydra_wrapper_and_exit_codes():
    _, ev = _parse('''
        Error executing job with overrides: ['trainer.n_gpus_per_node=8']
        Traceback (most recent call last):
          File "/x/main_ppo.py", line 30, in main
            run_ppo(config)
        AssertionError: ppo_mini_batch_size must be divisible by micro batch size
        Job entrypoint command failed with exit code 1, last available logs:
        Segmentation fault (core dumped)
        process exited with code 0
        ''')
    rows = list(ev.iter_rows(named=True))
    assert [(r["kind"], r["wrapper"], r["exc_type"], r["exit_code"], r["signal"]) for r in rows] == [
        ("python", "hydra", "AssertionError", None, None),
        ("exit", None, "exit 1", 1, None),
        ("exit", None, "SIGSEGV", None, "SIGSEGV"),
    ]
    assert rows[0]["line_no"] == 1 and rows[0]["exc_line"] == 5


def test_gnu_times_report_of_a_failed_command_is_an_exit():
    # `/usr/bin/time` (GNU) after a command that failed: "Command exited with non-zero status N"
    _, ev = _parse('''
        step:2 - actor/pg_loss:0.19
        Command exited with non-zero status 3
        1211.31user 88.02system 20:31.77elapsed 105%CPU (0avgtext+0avgdata 9342104maxresident)k
        the tool exited with status 0 and a non-zero count of warnings
        ''')
    assert [(r["line_no"], r["kind"], r["exit_code"]) for r in ev.iter_rows(named=True)] == [(2, "exit", 3)]


def test_an_exit_status_above_128_is_the_signal_that_ended_the_process():
    _, ev = _parse('''
        Process finished with exit code 137 (interrupted by signal 9: SIGKILL)
        container trainer exited with code 139
        worker exited with status 130
        ''')
    assert [(r["exit_code"], r["signal"], r["exc_type"]) for r in ev.iter_rows(named=True)] == [
        (137, "SIGKILL", "SIGKILL"), (139, "SIGSEGV", "SIGSEGV"), (130, None, "exit 130")]


def test_a_launchers_negative_return_code_is_the_signal():
    # DeepSpeed's launcher (Python's subprocess: minus the signal's number) and torch elastic
    _, ev = _parse('''
        [2025-03-02 10:04:13,002] [ERROR] [launch.py:325:sigkill_handler] ['/usr/bin/python', '-u', 'train.py', '--local_rank=1'] exits with return code = -9
        [2025-03-02 10:04:13,010] [ERROR] [launch.py:325:sigkill_handler] ['/usr/bin/python', '-u', 'train.py', '--local_rank=0'] exits with return code = 1
        E0302 10:04:14.000000 4300 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -11) local_rank: 0 (pid: 4315) of binary: /usr/bin/python3
        [2025-03-02 10:04:15,000] [INFO] [launch.py:351:main] Process 4413 exits with return code = 0
        ''')
    assert [(r["exit_code"], r["signal"]) for r in ev.iter_rows(named=True)] == [(-9, "SIGKILL"), (1, None), (-11, "SIGSEGV")]


def test_a_shell_reports_the_signal_that_ended_a_job():
    _, ev = _parse('''
        step:2 - actor/pg_loss:0.19
        ./run.sh: line 12:  1188 Killed                  python -m verl.trainer.main_ppo data.train_files=/d
        [1]+  Segmentation fault (core dumped) python serve.py
        Killed process 4411 (python) total-vm:81234kB
        the job was Killed by the operator, see the ticket
        ''')
    rows = list(ev.iter_rows(named=True))
    assert [(r["line_no"], r["kind"], r["signal"]) for r in rows] == [(2, "exit", "SIGKILL"), (3, "exit", "SIGSEGV")]


def test_traceback_cut_off_before_its_exception():
    e = _one('''
        [2025-02-24 14:09:34 TP14] Scheduler hit an exception: Traceback (most recent call last):
          File "/sgl/python/sglang/srt/managers/scheduler.py", line 1816, in run_scheduler_process
            scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, dp_rank)
          File "/sgl/python/sglang/srt/model_executor/model_runner.py", line 187,
        ''')
    assert (e["exc_type"], e["cut_off"], e["package"], e["exc_line"]) == ("unknown", True, "sglang", 1)


def test_logged_error_line_alone_is_an_event_but_prose_is_not():
    _, ev = _parse('''
        the run had no Error: just words
        ValueError: num_generations (8) must divide the global batch size (7)
        INFO all good
        ''')
    assert ev.select("exc_type", "line_no").rows() == [("ValueError", 2)]


def test_nothing_in_plain_logs():
    _, ev = _parse('''
        step:1 - actor/pg_loss:0.1 - critic/score/mean:0.5
        INFO 11-30 01:06:00 [llm.py:12] Processed prompts: 100%
        ''')
    assert ev.height == 0


@pytest.mark.parametrize("path, package", [
    ("/opt/conda/lib/python3.10/site-packages/torch/cuda/graphs.py", "torch"),
    ("/usr/local/lib/python3.10/dist-packages/megatron_core/dist_checkpointing/x.py", "megatron"),
    ("/usr/lib/python3.10/asyncio/tasks.py", "python"),
    ("/workspace/TTRL/verl/verl/workers/reward_manager/ttrl.py", "verl"),
    ("/workspace/code/vllm/vllm/config.py", "vllm"),
    ("/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", "sglang"),
    ("/workspace/code/OpenRLHF/openrlhf/trainer/ray/vllm_engine.py", "openrlhf"),
    (".../rllm/rllm/trainer/verl/train_agent_ppo.py", "user"),
    ("/home/me/project/reward.py", "user"),
    ("pyarrow/_dataset_parquet.pyx", "pyarrow"),
    ("/usr/local/bin/trl", "python"),
    ("D:\\Anaconda\\envs\\q\\Lib\\site-packages\\transformers\\trainer.py", "transformers"),
    ("D:\\Anaconda\\envs\\q\\Lib\\runpy.py", "python"),
])
def test_frame_package(path, package):
    assert frame_package(path) == package


def test_batch_and_single_file_parses_agree():
    """Many small files in one frame give each file the events it gives alone."""
    from forensics.parsers.text import parse_text_batch

    texts = [
        "Traceback (most recent call last):\n  File \"a.py\", line 1, in f\n    g()\nKeyError: 'x'\n",
        "ok\n*** SIGSEGV received at time=1 on cpu 0 ***\nPC: @ 0x1 (unknown)\n",
        "plain\n",
    ]
    singles = []
    sources = []
    for i, t in enumerate(texts, start=1):
        ctx = FileContext(file_id=i, path=f"f{i}.log", size=len(t), fmt="text")
        singles += [f for name, f in parse_text(io.BytesIO(t.encode()), ctx) if name == FATAL_EVENTS.name]
        sources.append((t.encode(), FileContext(file_id=i, path=f"f{i}.log", size=len(t), fmt="text")))
    batch = [f for name, f in parse_text_batch(sources) if name == FATAL_EVENTS.name]
    a = pl.concat(singles).sort("file_id", "line_no")
    b = pl.concat(batch).sort("file_id", "line_no")
    assert a.height == 2 and a.equals(b)


def test_a_last_line_without_newline_stays_in_its_traceback():
    """A paste cut at the end of the exception line (no final newline) is one event, also
    when the file is read in chunks."""
    text = ('Traceback (most recent call last):\n  File "/x/dp_actor.py", line 266, in compute_log_prob\n'
            '    entropy = f(logits)\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 13.91 GiB. See docu')
    for chunk in (len(text), 40):
        ctx = FileContext(file_id=1, path="w.err", size=len(text), fmt="text")
        events = [f for name, f in parse_text(io.BytesIO(text.encode()), ctx, chunk_bytes=chunk) if name == FATAL_EVENTS.name]
        if chunk == len(text):
            (ev,) = events
            assert ev.select("line_no", "exc_line", "exc_type").rows() == [(1, 4, "torch.OutOfMemoryError")]


def test_iter_chunks_keeps_an_unterminated_tail_with_its_chunk():
    from forensics.parsers.text import iter_chunks

    data = b"a1\nb2\nc3\ntail-without-newline"
    chunks = list(iter_chunks(io.BytesIO(data), chunk_bytes=6))
    assert b"".join(c for c, _ in chunks) == data and sum(n for _, n in chunks) == len(data)
    assert chunks[-1][0].endswith(b"\ntail-without-newline")  # not a chunk of its own


def test_watchdog_text_seen_only_from_what():
    e = _one('''
          what():  [PG ID 0 PG GUID 0(default_pg) Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=88, OpType=_ALLGATHER_BASE) ran for 1800032 milliseconds before timing out.
        Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:635 (most recent call first):
        ''')
    assert (e["kind"], e["exc_type"], e["cut_off"]) == ("cpp", "unknown", True)
    assert "Watchdog caught collective operation timeout" in e["message"]


def test_exceptions_python_reports_and_survives_are_marked():
    _, ev = _parse('''
        Exception ignored in: <function Engine.__del__ at 0x7f2a1c0d9b40>
        Traceback (most recent call last):
          File "/env/site-packages/vllm/engine.py", line 221, in __del__
            self.shutdown()
        AttributeError: 'Engine' object has no attribute 'handler'
        Error in atexit._run_exitfuncs:
        Traceback (most recent call last):
          File "/env/site-packages/wandb/sdk/wandb_run.py", line 80, in _atexit
            self.finish()
        BrokenPipeError: [Errno 32] Broken pipe
        ''')
    assert ev.select("line_no", "wrapper", "exc_type").rows() == [(1, "ignored", "AttributeError"), (6, "atexit", "BrokenPipeError")]


def test_wrapped_exception_right_under_its_ray_wrapper():
    e = _one('''
        ray.exceptions.RayTaskError(ActorDiedError): ray::WorkerDict.actor_rollout_update_actor() (pid=77, ip=10.0.0.2, actor_id=bb)
        ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
        	class_name: WorkerDict
        	pid: 77
        The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR
        ''')
    assert (e["exc_type"], e["exc_line"], e["last_line"], e["ray_method"]) == ("ray.exceptions.ActorDiedError", 2, 5, "actor_rollout_update_actor")


def test_every_fatal_event_of_the_corpus_has_a_type(ingested_corpus):
    """Real runs and re-authored bundles: every event names what failed (an exception type,
    a signal, FATAL for a fatal record, `unknown` only for a traceback cut before its end)."""
    import duckdb

    for case, db in ingested_corpus.items():
        con = duckdb.connect(str(db), read_only=True)
        try:
            bad = con.execute("SELECT line_no FROM fatal_events WHERE exc_type IS NULL OR exc_type = ''").fetchall()
            cut = con.execute("SELECT count(*) FROM fatal_events WHERE exc_type = 'unknown' AND NOT cut_off").fetchall()[0][0]
        finally:
            con.close()
        assert not bad and not cut, (case.name, bad)


def test_a_traceback_under_a_log_record_takes_its_level():
    lines, ev = _parse('''
        2025-10-02 09:05:00,000 WARNING reward.py:40 -- sandbox call failed, retrying
        Traceback (most recent call last):
          File "/home/team/rl/sandbox_client.py", line 33, in run_code
            return requests.post(url, json=payload, timeout=30).json()
        requests.exceptions.ReadTimeout: Read timed out. (read timeout=30)
        Traceback (most recent call last):
          File "/home/team/rl/main.py", line 9, in main
            fit()
        ValueError: bad
        ''')
    assert lines.filter(pl.col("line_no") == 5)["level"][0] == "WARNING"
    assert lines.filter(pl.col("line_no") == 9)["level"][0] == "ERROR"


def test_a_cut_off_traceback_cites_its_innermost_frame_and_what_it_raises():
    e = _one('''
        Traceback (most recent call last):
          File "/env/site-packages/transformers/training_args.py", line 1652, in _setup_devices
            torch.cuda.set_device(device)
          File "/env/site-packages/torch/cuda/__init__.py", line 399, in set_device
        ''')
    assert (e["exc_type"], e["cut_off"], e["exc_line"]) == ("unknown", True, 4)
    e = _one('''
          File "/env/site-packages/vllm/v1/core/kv_cache_utils.py", line 686, in check_enough_kv_cache_memory
            raise ValueError("No available memory for the cache blocks. "
                             "Try increasing `gpu_memory_utilization` when "
        ''')
    assert (e["exc_type"], e["message"], e["cut_off"], e["exc_line"]) == ("ValueError", "No available memory for the cache blocks.", True, 2)


def test_ipython_traceback_layout():
    e = _one('''
        ---------------------------------------------------------------------------
        ValueError                                Traceback (most recent call last)
        <ipython-input-41-5fa4> in <cell line: 14>()
             12 )
        ---> 14 trainer = Trainer(config=config, dataset=ds)

        3 frames
        /usr/local/lib/python3.10/dist-packages/torch/utils/data/sampler.py in __init__(self, data_source, replacement)
            142         if not isinstance(self.num_samples, int) or self.num_samples <= 0:
        --> 143             raise ValueError(f"num_samples should be a positive integer value, but got num_samples={self.num_samples}")

        ValueError: num_samples should be a positive integer value, but got num_samples=0
        ''')
    assert (e["exc_type"], e["line_no"], e["exc_line"], e["package"]) == ("ValueError", 2, 12, "torch")
    assert e["frames"][-1]["function"] == "__init__" and e["frames"][-1]["code"].startswith("raise ValueError")


_TRACEBACK_AFTER_RECORD = '''\
2025-06-02 11:04:51,017 INFO trainer.py:88 - step 41 started
Traceback (most recent call last):
  File "/opt/rl/train.py", line 212, in <module>
    main()
  File "/opt/rl/train.py", line 190, in main
    loss = step(batch)
KeyError: 'advantages'

2025-06-02 11:04:52,300 INFO trainer.py:99 - shutting down
'''


def _double_spaced(text: str) -> str:
    return "\n\n".join(text.split("\n"))


def test_double_spaced_paste_reads_as_the_log_it_was():
    """A paste with a blank line after every line (its CR LF line ends turned into two line
    feeds) holds the same event as the log: the spacing blanks neither end the traceback nor
    stand between a record and the traceback it logged, and the spacers inside the event
    belong to it. The log's own blank line (three blanks in the paste) still ends it."""
    _, plain = _parse(_TRACEBACK_AFTER_RECORD)
    lines, spaced = _parse(_double_spaced(_TRACEBACK_AFTER_RECORD))
    assert spaced.height == plain.height == 1
    a, b = plain.row(0, named=True), spaced.row(0, named=True)
    assert (b["exc_type"], b["message"], [f["function"] for f in b["frames"]]) == \
        (a["exc_type"], a["message"], [f["function"] for f in a["frames"]]) == ("KeyError", "'advantages'", ["<module>", "main"])
    ev = dict(zip(lines.get_column("line_no").to_list(), lines.get_column("event_line").to_list()))
    first = b["line_no"]
    assert first == 3 and all(ev[k] == first for k in range(3, 14)), ev  # Traceback .. KeyError, spacers too
    assert ev[14] is None and ev[17] is None  # the log's blank line and the next record


def test_blank_lines_of_a_normal_log_are_not_spacers():
    from forensics.parsers.fatal_events import spacer_lines
    df = pl.DataFrame({"file_id": [1] * 6 + [2] * 11,
                       "message": ["a", "", "b", "c", "", "d",  # file 1: blank lines between some records only
                                   # file 2: double-spaced, with one blank line of its own (three in a row)
                                   "", "w", "", "x", "", "y", "", "", "", "z", ""]})
    assert spacer_lines(df).to_list() == [False] * 6 + [True, False, True, False, True, False, True, True, False, False, True]


_CUT_TRACEBACK = '''\
(TaskRunner pid=4411) step 12 started, generating 512 sequences with 8 samples per prompt
Traceback (most recent call last):
  File "/opt/conda/lib/python3.10/site-packages/vllm/worker/model_runner.py", line 1544, in capture_model
    graph_runner.capture(**capture_inputs)
  File "/opt/conda/lib/python3.10/site-packages/torch/cuda/graphs.py", line 77, in capture_begin
    super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)
RuntimeError: CUDA error: operation not permitted when stream is capturing (cudaErrorStreamCaptureUnsupported)
'''


def _hard_wrapped(text: str, width: int) -> str:
    out = []
    for line in text.split("\n"):
        while len(line) > width:
            out.append(line[:width])
            line = line[width:]
        out.append(line)
    return "\n".join(out)


def test_hard_wrapped_paste_reads_each_cut_line_whole():
    """A paste that a terminal cut at a fixed width (here 72 columns): a frame line or the
    exception line cut in two is read whole, so the event has the frames and the message of
    the unwrapped log; the rest of a cut line belongs to the event."""
    _, plain = _parse(_CUT_TRACEBACK)
    lines, cut = _parse(_hard_wrapped(_CUT_TRACEBACK, 72))
    a, b = plain.row(0, named=True), cut.row(0, named=True)
    assert [f["function"] for f in b["frames"]] == [f["function"] for f in a["frames"]] == ["capture_model", "capture_begin"]
    assert (b["exc_type"], b["message"]) == (a["exc_type"], a["message"])
    assert a["message"].endswith("(cudaErrorStreamCaptureUnsupported)")
    ev = lines.filter(pl.col("event_line").is_not_null())
    assert ev.get_column("line_no").to_list() == list(range(b["line_no"], lines.height + 1))  # to the last piece


def test_wrapped_continuations_need_a_wrapped_file():
    from forensics.parsers.fatal_events import wrapped_continuations
    w = "x" * 70
    df = pl.DataFrame({"file_id": [1] * 6 + [2] * 4,
                       "text": [w[:-3] + "abc", "def", w[:-3] + "ghi", "jkl", w[:-3] + "mn ", "opq",  # cut at 70, one in padding
                                w + "y" * 10, "short", "a" * 70, "b"],  # file 2: only one line of the widest width
                       "header": [None] * 10})
    assert wrapped_continuations(df).to_list() == [False, True, False, True, False, False] + [False] * 4


def test_a_named_actors_task_is_a_ray_wrapper():
    """Ray names a named actor's task `ray::<actor name>:<Class>.<method>()` (the name may hold
    `-` and `:`); the creation-task report is the event's head, its remote frames follow."""
    ev = _one("""
        (PolicyWorker pid=5151) Exception raised in creation task: The actor died because of an error raised in its creation task, ray::policy-0-3:PolicyWorker.__init__() (pid=5151, ip=10.2.0.4, actor_id=ab12, repr=PolicyWorker[rank=3])
        (PolicyWorker pid=5151)   File "/srv/rl/policy_worker.py", line 266, in __init__
        (PolicyWorker pid=5151)     torch.distributed.broadcast(buf, src=0)
        """)
    assert ev["wrapper"] == "ray_task" and ev["line_no"] == 1 and ev["exc_line"] == 1
    assert ev["ray_actor"] == "PolicyWorker" and ev["ray_method"] == "__init__" and ev["ray_pid"] == 5151


def test_a_bare_exception_line_opens_a_chain_cut_above():
    """`Exception: ...` (Python's base class, raised as is) is an exception line: a paste that
    starts at it, then `During handling ...`, has it as the chain's first exception."""
    ev = _one("""
        (agent pid=77) Exception: Episode 4 failed after 3 retries
        (agent pid=77)
        (agent pid=77) During handling of the above exception, another exception occurred:
        (agent pid=77)
        (agent pid=77) Traceback (most recent call last):
        (agent pid=77)   File "/srv/agents/engine.py", line 50, in run_episode
        (agent pid=77)     raise e
        (agent pid=77) Exception: Episode 5 failed after 3 retries
        """)
    assert ev["exc_type"] == "Exception" and ev["exc_line"] == 1 and ev["message"] == "Episode 4 failed after 3 retries"
