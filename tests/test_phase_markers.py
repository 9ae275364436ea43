"""The built-in phase markers (signatures/phase_markers.yaml) on tracebacks of the shapes
that start-up failures print (tests/fixtures/SOURCES.md says where the shapes were seen);
the texts are written here. A marker of the start-up must not take a failure of a step."""
from __future__ import annotations

import re

import pytest

from forensics import catalogue as sig
from forensics.diagnosis.context import phase_of


@pytest.fixture(scope="module")
def markers():
    return [(p, re.compile(rx), o) for p, rx, o in sig.load().phase_markers]


def tb(*frames: tuple[str, int, str, str], exc: str = "ValueError: bad") -> str:
    out = ["Traceback (most recent call last):"]
    for path, line, fn, code in frames:
        out += [f'  File "{path}", line {line}, in {fn}', f"    {code}"]
    return "\n".join(out + [exc])


CONSTRUCTOR = tb(("/work/app/grpo.py", 200, "<module>", "main(args)"),
                 ("/work/app/grpo.py", 150, "main", "trainer = GRPOTrainer("),
                 ("/env/site-packages/trl/trainer/grpo_trainer.py", 400, "__init__", "raise ValueError("),
                 exc="ValueError: The global train batch size (3 x 1) must be evenly divisible by 4")
DATASET = tb(("/env/site-packages/datasets/builder.py", 1800, "_prepare_split_single", "for _, table in generator:"),
             ("/env/site-packages/datasets/packaged_modules/json/json.py", 90, "_generate_tables", "pa_table = read(f)"),
             exc="pyarrow.lib.ArrowInvalid: JSON parse error")
MEGATRON = tb(("/work/rl/scheduler/worker.py", 70, "sync_func", "return func(*args, **kwargs)"),
              ("/work/rl/workers/actor/megatron_actor.py", 270, "init_worker", "self.setup_model_and_optimizer()"),
              ("/work/rl/engines/megatron/manager.py", 140, "setup_model_and_optimizer", "self.model = build()"),
              exc="RuntimeError: Error(s) in loading state_dict")
STEP = tb(("/work/verl/trainer/main_ppo.py", 60, "run", "trainer.fit()"),
          ("/work/verl/trainer/ppo/ray_trainer.py", 1000, "fit", "actor_output = self.actor_rollout_wg.update_actor(batch)"),
          ("/work/verl/workers/actor/dp_actor.py", 400, "update_policy", "loss.backward()"),
          exc="torch.OutOfMemoryError: CUDA out of memory.")
ROLLOUT = tb(("/work/verl/trainer/ppo/ray_trainer.py", 990, "fit", "gen_batch_output = self.actor_rollout_wg.generate_sequences(gen_batch)"),
             ("/work/verl/workers/rollout/vllm_rollout.py", 300, "generate_sequences", "outputs = self.inference_engine.generate("),
             exc="RuntimeError: engine dead")

BUILDING = tb(("/work/sglang/srt/managers/scheduler.py", 1700, "run_scheduler_process",
               "scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank"), exc="")
SCORING = tb(("/env/site-packages/math_verify/parser.py", 499, "parse", "return extract_target(pred)"),
             ("/env/lib/python3.10/signal.py", 56, "signal", "handler = _signal.signal(n, h)"),
             exc="ValueError: signal only works in main thread of the main interpreter")

# a faulthandler stack: `File "...", line N in f`, innermost first
FORWARD = "\n".join(["Fatal Python error: Floating point exception", "", "Stack (most recent call first):",
                     '  File "/env/site-packages/vllm/model_executor/layers/logits_processor.py", line 80 in _get_logits',
                     '  File "/env/site-packages/torch/nn/modules/module.py", line 1500 in _call_impl'])

GENERATION_IN_STEP = tb(("/env/site-packages/transformers/trainer.py", 2500, "_inner_training_loop", "loss = self.training_step(model, inputs)"),
                        ("/env/site-packages/transformers/trainer.py", 3700, "training_step", "inputs = self._prepare_inputs(inputs)"),
                        ("/env/site-packages/trl/trainer/grpo_trainer.py", 519, "_prepare_inputs", "prompts = [x['prompt'] for x in inputs]"),
                        exc="KeyError: 'prompt'")


# An import that fails: the frame's source line is the import statement (a script's first
# lines, a Ray task importing the worker classes it is about to build): the start-up, unless
# a frame of a step's work runs it (a reward function importing its scorer when first called).
SCRIPT_IMPORT = tb(("/work/app/train_rl.py", 12, "<module>", "from rl_lib.trainers import PolicyTrainer"), exc="ImportError: cannot import name 'PolicyTrainer'")
TASK_IMPORT = tb(("/work/verl/trainer/main_ppo.py", 130, "main_task", "from verl.workers.fsdp_workers import ActorRolloutRefWorker"),
                 ("/work/verl/workers/fsdp_workers.py", 40, "<module>", "import flash_attn.bert_padding as fa_pad"), exc="ModuleNotFoundError: No module named 'flash_attn'")
ALGORITHM_SETUP = tb(("/work/rl/algorithms/grpo.py", 301, "setup", "policy = Policy(cfg.policy)"), exc="torch.AcceleratorError: CUDA error: out of memory")
LAZY_REWARD_IMPORT = tb(("/work/rewards/judge.py", 20, "compute_score", "from sympy_checker import equal"), exc="ModuleNotFoundError: No module named 'sympy_checker'")
# the driver starting Ray: the call, or the argument line Python shows inside a multi-line
# ray.init( (shape of rllm-org/rllm#197: an OmegaConf error while ray.init's arguments are built)
RAY_START = tb(("/work/app/train.py", 25, "main", "run_trainer(config)"), ("/work/app/train.py", 37, "run_trainer", "context = ray.init(num_cpus=8)"),
               exc="ConnectionError: could not connect to the cluster")
RAY_START_ARGUMENT = tb(("/work/app/train.py", 37, "run_trainer", "num_cpus=config.ray_init.num_cpus,"),
                        exc="omegaconf.errors.ConfigAttributeError: Key 'ray_init' is not in struct")
RAY_INIT_NAMED_IN_PASSING = tb(("/work/verl/trainer/ppo/ray_trainer.py", 1000, "fit", "self.log(ray_init_time=t0)"),
                               ("/work/verl/workers/actor/dp_actor.py", 400, "update_policy", "loss.backward()"), exc="torch.OutOfMemoryError: CUDA out of memory.")


@pytest.mark.parametrize("text, phase", [(CONSTRUCTOR, "init"), (DATASET, "init"), (MEGATRON, "init"), (BUILDING, "init"),
                                         (SCORING, "reward"), (FORWARD, "rollout"), (GENERATION_IN_STEP, "rollout"), (STEP, "train"), (ROLLOUT, "rollout"),
                                         (SCRIPT_IMPORT, "init"), (TASK_IMPORT, "init"), (LAZY_REWARD_IMPORT, "reward"), (ALGORITHM_SETUP, "init"),
                                         (RAY_START, "init"), (RAY_START_ARGUMENT, "init"), (RAY_INIT_NAMED_IN_PASSING, "train")],
                         ids=["trainer-constructor", "datasets-builder", "megatron-init-worker", "engine-being-built",
                              "reward-library", "engine-forward", "trl-generation-in-step", "train-step", "rollout",
                              "script-imports", "task-imports-workers", "reward-imports-lazily", "algorithm-setup",
                              "driver-starts-ray", "ray-init-argument-line", "ray-init-named-in-passing"])
def test_phase_of_a_traceback(markers, text, phase):
    assert phase_of(text, markers, frames_only=True) == phase


def test_a_ray_init_method_is_the_start_up(markers):
    assert phase_of("ray::MegatronActor.init_worker() (pid=4242, ip=10.0.0.2)", markers) == "init"


def test_an_engine_receiving_broadcast_weights_is_the_sync(markers):
    lines = "step:4 - actor/pg_loss:0.19\nupdate weight: model.layers.3.mlp.up_proj.weight, dtype: torch.bfloat16, shape: torch.Size([11008, 4096])"
    assert phase_of(lines, markers) == "sync"
    assert phase_of("we will update weight: decay later, dtype: none", markers) is None


def test_a_trainer_method_other_than_its_constructor_is_not_the_start_up(markers):
    text = tb(("/work/verl/trainer/ppo/ray_trainer.py", 1000, "fit", "self._validate()"),
              ("/work/verl/trainer/ppo/ray_trainer.py", 700, "_validate", "output = self.val_reward_fn(batch)"))
    assert phase_of(text, markers, frames_only=True) != "init"


# A reward function handed on as an argument by a driver frame (old verl's
# `ray.get(main_task.remote(config, compute_score))`, a keyword `reward_fn=reward_fn`) is not
# the reward running: the phase comes from what the frames below do.
PASSED_ON = ("/work/verl/trainer/main_ppo.py", 105, "run_ppo", "ray.get(main_task.remote(config, compute_score))")
HANDED_AS_KEYWORD = ("/work/app/entry.py", 40, "main", "launch(cfg, reward_fn=reward_fn, val_reward_fn=val_reward_fn)")


@pytest.mark.parametrize("outer", [PASSED_ON, HANDED_AS_KEYWORD], ids=["positional", "keyword"])
@pytest.mark.parametrize("inner, phase", [
    (("/work/verl/workers/rollout/vllm_rollout.py", 181, "generate_sequences", "output = self.inference_engine.generate("), "rollout"),
    (("/work/verl/workers/actor/dp_actor.py", 260, "update_policy", "loss.backward()"), "train"),
], ids=["rollout", "train"])
def test_a_reward_function_passed_as_an_argument_is_not_the_reward(markers, outer, inner, phase):
    text = tb(outer, ("/work/verl/trainer/ppo/ray_trainer.py", 700, "fit", "batch = self.step(batch)"), inner,
              exc="torch.OutOfMemoryError: CUDA out of memory.")
    assert phase_of(text, markers, frames_only=True) == phase


@pytest.mark.parametrize("frame", [
    ("/work/rewards/my_math.py", 17, "compute_score", "return float(pred == gt)"),
    ("/work/verl/workers/reward/naive.py", 44, "__call__", "score = compute_score(solution_str=s, ground_truth=g)"),
    ("/work/app/trainer.py", 90, "fit", "rewards = self.reward_fn (batch)"),
], ids=["its-frame", "called", "called-with-space"])
def test_a_reward_function_that_runs_is_the_reward(markers, frame):
    text = tb(("/work/app/trainer.py", 80, "fit", "batch = self.generate(batch)"), frame, exc="KeyError: 'answer'")
    assert phase_of(text, markers, frames_only=True) == "reward"


# vLLM V1's engine-core process lives in run_engine_core: it builds the engine there
# (EngineCoreProc(...), start-up) and then serves requests in its busy loop (the rollout).
ENGINE_CORE = ("/env/site-packages/vllm/v1/engine/core.py", 691, "run_engine_core", "engine_core.run_busy_loop()")


def test_an_engine_core_failing_in_its_busy_loop_is_the_rollout(markers):
    serving = tb(ENGINE_CORE,
                 ("/env/site-packages/vllm/v1/engine/core.py", 718, "run_busy_loop", "self._process_engine_step()"),
                 ("/env/site-packages/vllm/v1/executor/multiproc_executor.py", 243, "get_response", "raise RuntimeError("),
                 exc="RuntimeError: Worker failed with error 'CUDA error: an illegal memory access was encountered")
    assert phase_of(serving, markers, frames_only=True) == "rollout"
    front_end = tb(("/env/site-packages/vllm/v1/engine/async_llm.py", 439, "output_handler", "outputs = await engine_core.get_output_async()"),
                   ("/env/site-packages/vllm/v1/engine/core_client.py", 843, "get_output_async", "raise self._format_exception(outputs) from None"),
                   exc="vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.")
    assert phase_of(front_end, markers, frames_only=True) == "rollout"


def test_an_engine_core_failing_while_it_is_built_is_the_start_up(markers):
    building = tb(("/env/site-packages/vllm/v1/engine/core.py", 1482, "run_engine_core", "engine_core = EngineCoreProc(*args, **kwargs)"),
                  ("/env/site-packages/vllm/v1/core/kv_cache_utils.py", 700, "check_enough_kv_cache_memory", "raise ValueError("),
                  exc="ValueError: To serve at least one request with the model's max seq len")
    assert phase_of(building, markers, frames_only=True) == "init"


def test_an_agent_trainers_generation_loop_is_the_rollout(markers):
    text = tb(("/work/agent/src/agent_ray_trainer.py", 912, "fit", "final_gen_batch_output = generation_manager.run_llm_loop("),
              ("/work/agent/llm_agent/generation.py", 287, "run_llm_loop", "next_obs_ids = self._process_next_obs(next_obs)"),
              ("/work/agent/verl/utils/torch_functional.py", 361, "postprocess_data", "raise NotImplementedError(msg)"),
              exc="NotImplementedError: sequence_length=5393 is larger than max_length=4096")
    assert phase_of(text, markers, frames_only=True) == "rollout"


def test_megatron_lm_initialising_is_the_start_up(markers):
    text = tb(("/work/Megatron-LM/megatron/training/training.py", 254, "pretrain", "initialize_megatron("),
              ("/work/Megatron-LM/megatron/training/initialize.py", 158, "_compile_dependencies", "torch.distributed.barrier()"),
              exc="RuntimeError: HIP error: invalid device function")
    assert phase_of(text, markers, frames_only=True) == "init"


# vLLM-Ascend (the `vllm_ascend` plugin) runs the engine's forward in its own modules: an
# attention, op or sampler frame of it is the rollout, as vLLM's own model_executor is.
@pytest.mark.parametrize("frame", [
    ("/env/site-packages/vllm_ascend/attention/attention_v1.py", 412, "forward", "torch_npu._npu_reshape_and_cache("),
    ("/env/site-packages/vllm_ascend/ops/rotary_embedding.py", 90, "rope_forward_oot", "torch_npu._npu_rotary_embedding("),
    ("/env/site-packages/vllm/attention/layer.py", 250, "forward", "return self.impl.forward(self, query, key, value)"),
], ids=["ascend-attention", "ascend-op", "vllm-attention"])
def test_an_ascend_engine_forward_is_the_rollout(markers, frame):
    text = tb(("/env/site-packages/torch/nn/modules/module.py", 1750, "_call_impl", "return forward_call(*args, **kwargs)"), frame,
              exc="RuntimeError: The Inner error is reported as above.")
    assert phase_of(text, markers, frames_only=True) == "rollout"


def test_a_dataloader_built_with_the_train_batch_size_is_the_start_up(markers):
    # the config key `train_batch_size` in a start-up frame's source line is not the
    # training call `train_batch(...)`
    text = tb(("/work/verl/trainer/ppo/ray_trainer.py", 480, "_create_dataloader",
               "self.train_dataloader = StatefulDataLoader(dataset=self.train_dataset, batch_size=self.config.data.train_batch_size)"),
              ("/env/site-packages/torch/utils/data/sampler.py", 165, "__init__", "raise ValueError("),
              exc="ValueError: num_samples should be a positive integer value, but got num_samples=0")
    assert phase_of(text, markers, frames_only=True) == "init"


def test_an_engine_building_its_process_groups_is_the_start_up(markers):
    text = tb(("/env/site-packages/vllm/engine/multiprocessing/engine.py", 391, "run_mp_engine", "engine = MQLLMEngine.from_vllm_config("),
              ("/env/site-packages/vllm/distributed/parallel_state.py", 1042, "init_distributed_environment", "torch.distributed.barrier()"),
              exc="RuntimeError: HCCL function error: HcclCommInitRootInfo(numRanks, &rootInfo, rank, &(comm->hcclComm_)), error code is 7")
    assert phase_of(text, markers, frames_only=True) == "init"


def test_a_call_that_mentions_import_is_not_an_import(markers):
    text = tb(("/work/app/train_rl.py", 50, "<module>", "import_weights(model, path)"), exc="ValueError: bad")
    assert phase_of(text, markers, frames_only=True) is None


# -- the lazily compiled markers the diagnosis uses (context.Marker) -------------------------

def _texts_to_try() -> list[str]:
    """Lines of every shape the markers meet: the tracebacks above, frames naming each
    marker's own words in other cases, non-ASCII text, and corpus lines when ../shared is
    there."""
    from pathlib import Path

    texts = [ln for t in (CONSTRUCTOR, DATASET, MEGATRON, STEP) for ln in t.split("\n")]
    for _, rx, _ in sig.load().phase_markers:
        for kw in sig._required_literals(list(sig.sre_parse.parse(rx))) or []:
            texts += [f'  File "/x/{kw}.py", line 1, in {kw}', f"    self.{kw.upper()}()", f"    {kw.lower()}(x)",
                      f"  File \"/x/İ{kw}.py\", line 2, in run"]
    corpus = Path(__file__).resolve().parents[2] / "shared" / "corpus"
    for f in sorted(corpus.glob("public/*/**/*.log"))[:40] if corpus.is_dir() else []:
        texts += f.read_text(encoding="utf-8", errors="replace").splitlines()[:400]
    return texts


def test_lazy_markers_agree_with_their_regexes():
    from forensics.diagnosis.context import Marker

    cat = sig.load()
    kws = cat.marker_keywords()
    assert len(kws) == len(cat.phase_markers) and sum(k is not None for k in kws) >= len(kws) - 3
    texts = _texts_to_try()
    for (_, rx, _), kw in zip(cat.phase_markers, kws):
        lazy, plain = Marker(rx, kw), re.compile(rx)
        for t in texts:
            assert bool(lazy.search(t)) == bool(plain.search(t)), (rx, t)


@pytest.mark.parametrize("pattern, hit, miss", [
    (r"(?i)update_weights", "X.UPDATE_WEIGHTS()", "update_weight"),
    (r"foo(?i:bar)", "fooBAR", "foo"),  # no literal is required of (?i:...): always tried
    (r"save_(?:checkpoint|pretrained)\b", "model.save_pretrained(p)", "save_config"),
])
def test_a_lazy_marker_matches_what_its_regex_matches(pattern, hit, miss):
    from forensics.diagnosis.context import Marker

    m = Marker(pattern, sig._keywords_or_none(pattern))
    assert m.search(hit) and not m.search(miss)
    assert m.search("Ünïcode " + hit)  # non-ASCII text skips the lowered test, not the match



# Generation and log-prob frames of other RL frameworks (shapes of hiyouga/LlamaFactory#8114,
# NVIDIA-NeMo/RL#1178, rllm-org/rllm#176) and AReaL's engine set-up (areal-project/AReaL#240, #1186)
TRL_GATHER_FOR_GENERATION = tb(("/opt/py/trl/trainer/ppo_trainer.py", 480, "train", "with unwrap_model_for_generation(self.model, self.accelerator) as unwrapped:"),
                               ("/opt/py/trl/models/utils.py", 170, "unwrap_model_for_generation", "add_hooks(model)"),
                               exc="AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'register_hooks'")
NEMO_LOGPROBS = tb(("/srv/rl/nemo_rl/algorithms/grpo.py", 790, "grpo_train", "fprop = policy.get_logprobs(train_data)[\"logprobs\"]"),
                   ("/srv/rl/nemo_rl/models/policy/lm_policy.py", 270, "get_logprobs", "self.worker_group.get_all_worker_results(futures)"),
                   exc="RuntimeError: shape mismatch")
RLLM_TRAJECTORY = tb(("/srv/rllm/rllm/engine/agent_execution_engine.py", 480, "run_agent_trajectory_with_retry", "raise Exception(f\"Trajectory {idx} failed\")"),
                     exc="Exception: Trajectory 3 failed")
AREAL_INITIALIZE = tb(("/srv/areal/examples/math/train.py", 80, "main", "rollout.initialize(None, spec)"),
                      ("/srv/areal/areal/engine/sglang_remote.py", 70, "initialize", "self._wait_for_server(addr)"),
                      exc="RuntimeError: server launch failed")


@pytest.mark.parametrize("text, phase", [(TRL_GATHER_FOR_GENERATION, "rollout"), (NEMO_LOGPROBS, "rollout"),
                                         (RLLM_TRAJECTORY, "rollout"), (AREAL_INITIALIZE, "init")],
                         ids=["trl-unwrap-for-generation", "nemo-rl-logprobs", "rllm-trajectory", "areal-initialize"])
def test_phase_in_other_rl_frameworks(markers, text, phase):
    assert phase_of(text, markers, frames_only=True) == phase
