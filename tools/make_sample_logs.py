"""Write sample_logs/: a small, realistic failed verl run for the quick start.

    python tools/make_sample_logs.py [OUT_DIR]

The story: GRPO on Qwen2.5-7B, 2 nodes x 4 GPUs, FSDP actor + vLLM rollout (hybrid
engine). Six steps run normally. In step 7 rank 6 (node gpu-b) runs out of GPU memory
in the backward pass of update_actor; its worker dies; the other seven ranks wait in
the gradient all-reduce until the 600 s NCCL watchdog fires; the driver reports
ActorDiedError and Hydra's "Error executing job". The OOM traceback is only in the
dead worker's own Ray log file on node gpu-b (the driver's copy was lost).

Every line follows the format the real software prints (Ray driver prefixes and
session logs, c10d watchdog, torch OOM text, NCCL INFO, vLLM, verl prints and metric
lines); names, addresses, pids, numbers are invented. Output is deterministic.
"""
from __future__ import annotations

import json
import random
import sys
from datetime import datetime, timedelta
from pathlib import Path

ESC = "\x1b"
T0 = datetime(2026, 3, 9, 14, 2, 7)
HEAD_IP, NODE_B_IP = "10.20.0.11", "10.20.0.12"
HOSTS = ["gpu-a", "gpu-a", "gpu-a", "gpu-a", "gpu-b", "gpu-b", "gpu-b", "gpu-b"]
IPS = [HEAD_IP] * 4 + [NODE_B_IP] * 4
PIDS = [31201, 31202, 31203, 31204, 18811, 18812, 18813, 18814]
TASK_PID = 31090
SEQ_FAIL = 2917
STEPS_OK = 6


def ray_py(ts: datetime, level: str, where: str, msg: str) -> str:
    return f"{ts:%Y-%m-%d %H:%M:%S},{ts.microsecond // 1000:03d}\t{level} {where} -- {msg}"


def ray_cpp(ts: datetime, level: str, pid: int, tid: int, comp: str | None, where: str, msg: str) -> str:
    tag = f"({comp}) " if comp else ""
    return f"[{ts:%Y-%m-%d %H:%M:%S},{ts.microsecond // 1000:03d} {level} {pid} {tid}] {tag}{where}: {msg}"


def prefix(actor: str, pid: int, ip: str | None) -> str:
    where = f"pid={pid}" if ip in (None, HEAD_IP) else f"pid={pid}, ip={ip}"
    return f"{ESC}[36m({actor} {where}){ESC}[0m "


def glog(ts: datetime, level: str, where: str) -> str:
    return f"[{level}{ts.month}{ts.day:02d} {ts:%H:%M:%S}.{ts.microsecond:06d}{random.randint(100, 999)} {where}]"


def vllm(ts: datetime, level: str, where: str, msg: str) -> str:
    return f"{level} {ts:%m-%d %H:%M:%S} [{where}] {msg}"


def build(out: Path) -> None:
    random.seed(7)
    (out / "ray_logs" / "gpu-a").mkdir(parents=True, exist_ok=True)
    (out / "ray_logs" / "gpu-b").mkdir(parents=True, exist_ok=True)
    driver: list[str] = []
    metrics: list[str] = []
    t = T0

    driver += [
        "+ python3 -m verl.trainer.main_ppo \\",
        "    algorithm.adv_estimator=grpo \\",
        "    data.train_files=/mnt/data/gsm8k/train.parquet \\",
        "    data.train_batch_size=512 \\",
        "    data.max_prompt_length=1024 \\",
        "    data.max_response_length=3072 \\",
        "    actor_rollout_ref.model.path=/mnt/models/Qwen2.5-7B-Instruct \\",
        "    actor_rollout_ref.actor.optim.lr=1e-6 \\",
        "    actor_rollout_ref.actor.ppo_mini_batch_size=128 \\",
        "    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \\",
        "    actor_rollout_ref.model.enable_gradient_checkpointing=False \\",
        "    actor_rollout_ref.actor.fsdp_config.param_offload=False \\",
        "    actor_rollout_ref.rollout.name=vllm \\",
        "    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \\",
        "    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \\",
        "    actor_rollout_ref.rollout.n=8 \\",
        "    trainer.logger=['console','wandb'] \\",
        "    trainer.n_gpus_per_node=4 \\",
        "    trainer.nnodes=2 \\",
        "    trainer.total_epochs=3",
        ray_py(t, "INFO", "worker.py:1660", f"Connecting to existing Ray cluster at address: {HEAD_IP}:6379..."),
        ray_py(t + timedelta(milliseconds=412), "INFO", "worker.py:1843", f"Connected to Ray cluster. View the dashboard at {HEAD_IP}:8265 "),
    ]
    t += timedelta(seconds=3)
    p = prefix("TaskRunner", TASK_PID, None)
    driver.append(p + f"TaskRunner hostname: gpu-a, PID: {TASK_PID}")
    config = {
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 128, "ppo_micro_batch_size_per_gpu": 16, "strategy": "fsdp",
                      "fsdp_config": {"param_offload": False, "optimizer_offload": False}, "grad_clip": 1.0,
                      "optim": {"lr": 1e-06}},
            "model": {"enable_gradient_checkpointing": False, "path": "/mnt/models/Qwen2.5-7B-Instruct"},
            "rollout": {"gpu_memory_utilization": 0.6, "log_prob_micro_batch_size_per_gpu": 32, "n": 8,
                        "name": "vllm", "tensor_model_parallel_size": 2, "enforce_eager": False},
        },
        "data": {"max_prompt_length": 1024, "max_response_length": 3072, "train_batch_size": 512},
        "trainer": {"n_gpus_per_node": 4, "nnodes": 2, "total_epochs": 3, "save_freq": 20, "test_freq": 10},
    }
    import pprint

    for line in pprint.pformat(config, width=100).splitlines():
        driver.append(p + line)
    driver += [p + "Using dataset class: RLHFDataset", p + "dataset len: 7473", p + "filter dataset len: 7473",
               p + "Size of train dataloader: 14, Size of val dataloader: 1", p + "Total training steps: 42"]
    # worker start-up: NCCL init and vLLM engine on every rank
    for r in range(8):
        t += timedelta(milliseconds=137)
        pw = prefix("WorkerDict", PIDS[r], IPS[r])
        host, pid = HOSTS[r], PIDS[r]
        dev = r % 4
        if r == 0:
            driver.append(pw + "NCCL version 2.21.5+cuda12.4")
        driver += [
            pw + f"{host}:{pid}:{pid} [{dev}] NCCL INFO Bootstrap : Using eth0:{IPS[r]}<0>",
            pw + f"{host}:{pid}:{pid} [{dev}] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:{IPS[r]}<0>",
            pw + f"{host}:{pid}:{pid} [{dev}] NCCL INFO ncclCommInitRank comm 0x5{r}a7c0e0 rank {r} nranks 8 cudaDev {dev} nvmlDev {dev} busId {18 + 16 * dev:x}000 commId 0x9f3ab2c4d1e07a55 - Init START",
            pw + f"{host}:{pid}:{pid} [{dev}] NCCL INFO ncclCommInitRank comm 0x5{r}a7c0e0 rank {r} nranks 8 cudaDev {dev} nvmlDev {dev} busId {18 + 16 * dev:x}000 commId 0x9f3ab2c4d1e07a55 - Init COMPLETE",
        ]
    for r in range(0, 8, 2):
        t += timedelta(seconds=2)
        pw = prefix("WorkerDict", PIDS[r], IPS[r])
        driver += [
            pw + vllm(t, "INFO", "gpu_worker.py:227", f"Available KV cache memory: {21.37 + r / 10:.2f} GiB"),
            pw + vllm(t, "INFO", "kv_cache_utils.py:634", f"GPU KV cache size: {800391 + r * 1000:,} tokens"),
            pw + vllm(t, "INFO", "kv_cache_utils.py:637", f"Maximum concurrency for 4,096 tokens per request: {195.41 + r:.2f}x"),
        ]
    t += timedelta(seconds=20)
    driver.append(p + "Training from scratch")
    # six good steps
    for step in range(1, STEPS_OK + 1):
        gen = random.uniform(95, 110) + (25 if step == 4 else 0)
        lp = random.uniform(14, 17)
        upd = random.uniform(60, 66)
        sync = random.uniform(6, 8)
        total = gen + 2.1 + lp + upd + sync
        entropy = 0.61 - 0.012 * step + random.uniform(-0.005, 0.005)
        score = 0.42 + 0.035 * step + random.uniform(-0.01, 0.01)
        grad = random.uniform(0.21, 0.33)
        data = {
            "actor/entropy": round(entropy, 6), "actor/kl_loss": round(0.0011 * step, 6), "actor/pg_loss": round(random.uniform(-0.03, 0.03), 6),
            "actor/pg_clipfrac": round(random.uniform(0.001, 0.004), 6), "actor/ppo_kl": round(random.uniform(-0.0003, 0.0006), 6),
            "actor/grad_norm": round(grad, 6), "actor/lr": 1e-06, "critic/score/mean": round(score, 6), "critic/rewards/mean": round(score, 6),
            "response_length/mean": round(410 + 12 * step + random.uniform(-5, 5), 3), "response_length/clip_ratio": round(random.uniform(0, 0.01), 6),
            "perf/throughput": round(512 * 8 * 450 / total / 8, 3), "perf/max_memory_allocated_gb": round(61.2 + step * 0.8, 3),
            "timing_s/gen": round(gen, 6), "timing_s/reward": 2.1, "timing_s/old_log_prob": round(lp, 6),
            "timing_s/update_actor": round(upd, 6), "timing_s/update_weights": round(sync, 6), "timing_s/step": round(total, 6),
        }
        t += timedelta(seconds=total)
        driver.append(p + f"step:{step} - " + " - ".join(f"{k}:{v:.3f}" if isinstance(v, float) else f"{k}:{v}" for k, v in data.items()))
        driver.append(f"Training Progress:  {100 * step // 42}%|{'#' * (step // 5)}{' ' * (10 - step // 5)}| {step}/42 [{int((t - T0).total_seconds()) // 60:02d}:{int((t - T0).total_seconds()) % 60:02d}<1:05:12, {total:.2f}s/it]")
        metrics.append(json.dumps({"step": step, "data": data}))
    # step 7: rank 6 dies in backward, the others time out
    t_oom = t + timedelta(seconds=118.4)
    worker_b = out / "ray_logs" / "gpu-b" / f"worker-6b1f0c2de93a8e7741f05c9a1d2b3e4f5a6b7c8d9e0f1a2b3c4d5e6f-01000000-{PIDS[6]}.err"
    err_lines = [
        ":job_id:01000000",
        ":actor_name:WorkerDict",
        f"{PIDS[6]}: UserWarning: torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly.",
        "Traceback (most recent call last):",
        '  File "/opt/conda/lib/python3.10/site-packages/ray/_private/function_manager.py", line 726, in actor_method_executor',
        "    return method(__ray_actor, *args, **kwargs)",
        '  File "/workspace/verl/verl/single_controller/base/decorator.py", line 540, in inner',
        "    return func(*args, **kwargs)",
        '  File "/workspace/verl/verl/workers/fsdp_workers.py", line 612, in update_actor',
        "    metrics = self.actor.update_policy(data=data)",
        '  File "/workspace/verl/verl/workers/actor/dp_actor.py", line 402, in update_policy',
        "    loss.backward()",
        '  File "/opt/conda/lib/python3.10/site-packages/torch/_tensor.py", line 626, in backward',
        "    torch.autograd.backward(",
        '  File "/opt/conda/lib/python3.10/site-packages/torch/autograd/graph.py", line 823, in _engine_run_backward',
        "    return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.64 GiB. GPU 2 has a total capacity of 79.11 GiB of which 3.02 GiB is free. "
        "Including non-PyTorch memory, this process has 76.08 GiB memory in use. Of the allocated memory 71.37 GiB is allocated by PyTorch, "
        "and 3.20 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
    ]
    worker_b.write_text("\n".join(err_lines) + "\n")
    (out / "ray_logs" / "gpu-b" / worker_b.name.replace(".err", ".out")).write_text(
        ":job_id:01000000\n:actor_name:WorkerDict\n"
        + "".join(f"{HOSTS[6]}:{PIDS[6]}:{PIDS[6]} [2] NCCL INFO Channel {c:02d}/0 : 6[2] -> 7[3] via P2P/IPC/read\n" for c in range(4))
    )
    raylet_b = [
        ray_cpp(T0 + timedelta(seconds=1), "I", 7712, 7712, "raylet", "main.cc:225", "Setting cluster ID to: 5c0fa41de2a94c0b8f3c21e9d7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2"),
        ray_cpp(T0 + timedelta(seconds=2), "I", 7712, 7712, "raylet", "node_manager.cc:525", "[state-dump] NodeManager:"),
        "[state-dump] Node ID: 8d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a",
        "[state-dump] Node name: " + NODE_B_IP,
        ray_cpp(t_oom + timedelta(seconds=1.2), "I", 7712, 7712, "raylet", "node_manager.cc:1146",
                f"Disconnecting client, graceful=false, exit_type=SYSTEM_ERROR, has_creation_task_exception=false, worker_id=6b1f0c2de93a8e7741f05c9a1d2b3e4f5a6b7c8d9e0f1a2b3c4d5e6f, pid={PIDS[6]}"),
        ray_cpp(t_oom + timedelta(seconds=1.3), "W", 7712, 7712, "raylet", "node_manager.cc:1208",
                f"A worker died or was killed while executing a task by an unexpected system error. Worker PID: {PIDS[6]}"),
    ]
    (out / "ray_logs" / "gpu-b" / "raylet.out").write_text("\n".join(raylet_b) + "\n")
    raylet_a = [
        ray_cpp(T0, "I", 30111, 30111, "raylet", "main.cc:225", "Setting cluster ID to: 5c0fa41de2a94c0b8f3c21e9d7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2"),
        ray_cpp(T0 + timedelta(seconds=1), "I", 30111, 30111, "raylet", "store_runner.cc:50", "Allowing the Plasma store to use up to 64.0GB of memory."),
        ray_cpp(t_oom + timedelta(seconds=603), "I", 30111, 30111, "raylet", "node_manager.cc:1146",
                f"Disconnecting client, graceful=false, exit_type=SYSTEM_ERROR, has_creation_task_exception=false, worker_id=0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f, pid={PIDS[0]}"),
    ]
    (out / "ray_logs" / "gpu-a" / "raylet.out").write_text("\n".join(raylet_a) + "\n")
    # the watchdog fires ~600 s later on the 7 survivors
    t_to = t_oom + timedelta(seconds=600.9)
    for r in [0, 1, 2, 3, 4, 5, 7]:
        pw = prefix("WorkerDict", PIDS[r], IPS[r])
        ts = t_to + timedelta(milliseconds=r * 3)
        op = f"WorkNCCL(SeqNum={SEQ_FAIL}, OpType=ALLREDUCE, NumelIn=136314880, NumelOut=136314880, Timeout(ms)=600000)"
        driver += [
            pw + f"[rank{r}]:" + glog(ts, "E", "ProcessGroupNCCL.cpp:616") + f" [Rank {r}] Watchdog caught collective operation timeout: {op} ran for 600097 milliseconds before timing out.",
            pw + f"[rank{r}]:" + glog(ts, "E", "ProcessGroupNCCL.cpp:1785") + f" [PG ID 0 PG GUID 0(default_pg) Rank {r}] Exception (either an error or timeout) detected by watchdog at work: {SEQ_FAIL}, last enqueued NCCL work: {SEQ_FAIL}, last completed NCCL work: {SEQ_FAIL - 1}.",
            pw + f"[rank{r}]:" + glog(ts, "E", "ProcessGroupNCCL.cpp:630") + f" [Rank {r}] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.",
            pw + f"[rank{r}]:" + glog(ts, "E", "ProcessGroupNCCL.cpp:636") + f" [Rank {r}] To avoid data inconsistency, we are taking the entire process down.",
            pw + "terminate called after throwing an instance of 'c10::DistBackendError'",
            pw + f"  what():  [PG ID 0 PG GUID 0(default_pg) Rank {r}] Process group watchdog thread terminated with exception: [Rank {r}] Watchdog caught collective operation timeout: {op} ran for 600097 milliseconds before timing out.",
            pw + f"*** SIGABRT received at time={int(ts.timestamp())} on cpu {random.randint(0, 95)} ***",
        ]
    t_end = t_to + timedelta(seconds=2)
    driver += [
        f"(raylet, ip={NODE_B_IP}) A worker died or was killed while executing a task by an unexpected system error. To troubleshoot the problem, check the logs for the dead worker. "
        f"RayTask ID: ffffffffffffffff9c1a2b3c4d5e6f7a8b9c0d1e01000000 Worker ID: 6b1f0c2de93a8e7741f05c9a1d2b3e4f5a6b7c8d9e0f1a2b3c4d5e6f Node ID: 8d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a "
        f"Worker IP address: {NODE_B_IP} Worker port: 10031 Worker PID: {PIDS[6]} Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file. "
        "There are some potential root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage. (2) ray stop --force is called. (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected errors.",
        "Error executing job with overrides: ['algorithm.adv_estimator=grpo', 'trainer.n_gpus_per_node=4', 'trainer.nnodes=2']",
        "Traceback (most recent call last):",
        '  File "/workspace/verl/verl/trainer/main_ppo.py", line 39, in main',
        "    run_ppo(config)",
        '  File "/workspace/verl/verl/trainer/main_ppo.py", line 69, in run_ppo',
        "    ray.get(runner.run.remote(config))",
        '  File "/opt/conda/lib/python3.10/site-packages/ray/_private/worker.py", line 2771, in get',
        "    values, debugger_breakpoint = worker.get_objects(object_refs, timeout=timeout)",
        '  File "/opt/conda/lib/python3.10/site-packages/ray/_private/worker.py", line 919, in get_objects',
        "    raise value.as_instanceof_cause()",
        f"ray.exceptions.RayTaskError(ActorDiedError): {ESC}[36mray::TaskRunner.run(){ESC}[39m (pid={TASK_PID}, ip={HEAD_IP}, actor_id=2f4e6a8c0b1d3f5a7c9e1b3d01000000, repr=<main_ppo.TaskRunner object at 0x7f3c2a1b9d50>)",
        '  File "/workspace/verl/verl/trainer/ppo/ray_trainer.py", line 1012, in fit',
        "    actor_output = self.actor_rollout_wg.update_actor(batch)",
        '  File "/workspace/verl/verl/single_controller/ray/base.py", line 49, in __call__',
        "    output = ray.get(output)",
        "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
        "\tclass_name: create_colocated_worker_cls.<locals>.WorkerDict",
        "\tactor_id: 7a9c1e3f5b7d9f1a3c5e7b9d01000000",
        f"\tpid: {PIDS[6]}",
        "\tname: Xq3kLmWorkerDict_0:6",
        "\tnamespace: 3c5e7a9b-1d3f-4a5b-8c7d-9e0f1a2b3c4d",
        f"\tip: {NODE_B_IP}",
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file. "
        "There are some potential root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage. (2) ray stop --force is called. (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected errors.",
        "",
        "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.",
    ]
    (out / "driver.log").write_text("\n".join(driver) + "\n")
    (out / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
    _ = t_end


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "sample_logs"
    build(target)
    total = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    print(f"wrote {target} ({total / 1024:.0f} KB)")
