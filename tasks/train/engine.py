"""A training worker's DeepSpeed engine: the process group Ray made, joined by DeepSpeed; the model
(partitioned at load for ZeRO-3, its last layer at the first token, checkpointed activations where
asked); its parameter groups; the precision resolved on the worker's device; the replica that trains
it (tasks/train/replica.py). Worker side: imports no Prefect."""

from __future__ import annotations

import functools
import logging
import warnings
from datetime import timedelta

import ray.train.torch
import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    set_seed,
)
from transformers.integrations.deepspeed import HfDeepSpeedConfig

from tasks.core.attention import without_cudnn_attention
from tasks.core.first_token import last_layer_at_first_token
from tasks.core.models import hub_free
from tasks.core.ops import CPU_ADAM, interrupted_build_cleared
from tasks.core.progress import say
from tasks.core.targets import Targets
from tasks.core.text import padding
from tasks.train import pipeline
from tasks.train.lora import adapted, parameter_counts
from tasks.train.replica import Replica
from tasks.train.spec import WorkerSpec
from tasks.train.watch import Pulse


def build_model(spec: WorkerSpec, pad_token_id: int):
    # While this object lives, from_pretrained builds a ZeRO-3 model already partitioned (zero.Init):
    # no worker ever holds the whole model, which is what lets ZeRO-3 fit models that do not fit.
    # transformers 5.23 refuses to load under zero.Init when the config asks for tensor parallelism
    # ("Weight conversions ... not yet implemented"): then each worker loads it whole, and the
    # engine splits it, then partitions its shards.
    # Nor can it replace a classifier of another shape (ignore_mismatched_sizes does not reach it):
    # a fine-tuned model trained to other outputs is loaded whole too, and partitioned by the engine.
    fits = spec.init == "random" or head_fits(spec)
    partitioned = spec.train.zero_stage == 3 and spec.train.tensor_parallel_size == 1 and fits
    zero_init = HfDeepSpeedConfig(spec.deepspeed) if partitioned else None  # noqa: F841 (kept alive)
    model, loading = loaded(spec, pad_token_id)
    if spec.targets.task != "token_classification":  # a token classifier reads every token's last layer
        start_at_priors(model, spec.targets)
        last_layer_at_first_token(model)
    if spec.train.activation_checkpointing and spec.train.pipeline_parallel_size == 1:  # stages checkpoint their own
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.train.lora:
        model = adapted(model, spec.train.lora, spec.targets.task, loading["missing_keys"])
    return model


def loaded(spec: WorkerSpec, pad_token_id: int) -> tuple[torch.nn.Module, dict]:
    """The model as a classifier of the targets, and transformers' loading info (its missing keys: the
    weights the checkpoint did not have, which LoRA trains in full). `init: random` draws every weight by
    the config's initialiser (seeded: setup), on this worker, and reads none: nothing is missing."""
    names, tagged = spec.targets.names, spec.targets.task == "token_classification"
    outputs = {"problem_type": spec.targets.problem_type} if not tagged else {}  # the loss (tasks/core/objective.py)
    classifier = {
        "num_labels": len(names),
        "id2label": dict(enumerate(names)),
        "label2id": {name: i for i, name in enumerate(names)},
        "pad_token_id": pad_token_id,  # what a decoder's classifier finds the last real token by, in its exported config
        **outputs,
    }
    auto = AutoModelForTokenClassification if tagged else AutoModelForSequenceClassification
    if spec.init == "random":
        config = AutoConfig.from_pretrained(spec.model, **classifier, **hub_free(spec.model))
        return auto.from_config(config), {"missing_keys": []}
    return auto.from_pretrained(
        spec.model,
        ignore_mismatched_sizes=True,  # a classifier of other outputs (a fine-tuned model's): a new head
        output_loading_info=True,
        **classifier,
        **hub_free(spec.model),
    )


def head_fits(spec: WorkerSpec) -> bool:
    """Whether the model's checkpoint holds no classifier (a base model's), or one of the outputs asked for."""
    config = AutoConfig.from_pretrained(spec.model, **hub_free(spec.model))
    heads = ("ForSequenceClassification", "ForTokenClassification")
    classifier = any(name.endswith(heads) for name in config.architectures or [])
    return not classifier or config.num_labels == spec.targets.width


def start_at_priors(model, targets: Targets) -> None:
    """A multi-label or regression classifier's bias set to the training split's priors: each label's
    log-odds, each number's mean, so that training starts where a model that learned nothing ends.
    From a bias of 0 instead (every label at probability 0.5, every number at 0), the first steps
    pushed every output toward the priors through the whole encoder: MiniLM on 4,000 GoEmotions rows
    collapsed to one representation for every text (its outputs the priors, whatever the text)."""
    if targets.priors is None or targets.task == "single_label":
        return
    import deepspeed

    priors = torch.tensor(targets.priors, dtype=torch.float32)
    if targets.task == "multi_label":
        priors = torch.logit(priors.clamp(1e-4, 1 - 1e-4))
    head = model.classifier if hasattr(model, "classifier") else model.score  # an encoder's head, a decoder's
    bias = [module for module in head.modules() if isinstance(module, torch.nn.Linear)][-1].bias
    if bias is None:  # a decoder's score layer has none (GPT-2, Llama, Qwen, Mistral, Gemma): it starts at 0
        return
    with deepspeed.zero.GatheredParameters([bias], modifier_rank=0), torch.no_grad():  # ZeRO-3: partitioned
        bias.copy_(priors.to(bias.dtype))


def param_groups(model) -> list[dict]:
    """Weight decay for weight matrices only, as BERT-style recipes do; frozen parameters (LoRA's base
    model) in neither group."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in named if p.ndim > 1]},
        {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0},
    ]


def join_process_group(device: torch.device, timeout_s: float) -> None:
    """DeepSpeed's view of the process group Ray made (with TorchConfig's timeout); DeepSpeed's own
    groups (ZeRO, tensor and pipeline parallelism) get the same bound instead of its 30 minutes."""
    import deepspeed

    if device.type == "cpu":
        # DeepSpeed builds its shared-memory collective op at every init_distributed on CPU (~30 s of
        # compile on a fresh machine) for DeepSpeed-Inference's all-reduce alone: training's collectives
        # go through torch.distributed. Marked unavailable, it is not built (DeepSpeed keeps this dict).
        # Not on CUDA: there the op does not exist, and reading the dict runs DeepSpeed's op probe,
        # which calls nvcc several times.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(
        dist_backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s)
    )


def precision_of(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def resolve_precision(spec: WorkerSpec, device: torch.device) -> WorkerSpec:
    """precision=auto on a GPU (the driver cannot see it): bf16 where the hardware has it, else fp16."""
    if spec.plan.precision == "auto":
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        spec = spec.model_copy(
            update={
                "deepspeed": spec.deepspeed
                | {
                    "bf16": spec.deepspeed["bf16"] | {"enabled": precision == "bf16"},
                    "fp16": spec.deepspeed["fp16"] | {"enabled": precision == "fp16"},
                }
            }
        )
    if spec.deepspeed["bf16"]["enabled"] and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision=bf16 but {torch.cuda.get_device_name()} has no bf16: use fp16 or auto")
    return spec


def setup(spec: WorkerSpec, pulse: Pulse) -> tuple:
    """This worker's part: the process group, the tokenizer, the DeepSpeed engine and its replica."""
    import deepspeed  # imported in the worker: it probes the accelerator at import

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames used by DeepSpeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    set_seed(spec.train.seed)
    # The worker's CPU share (1 beside a GPU by default): the host side of a GPU step (collate, the
    # Python loop) is single-threaded, and offloaded optimizer state steps on cpus_per_worker threads.
    torch.set_num_threads(max(1, int(spec.plan.cpus_per_worker)))
    device = ray.train.torch.get_device()
    without_cudnn_attention()
    spec = resolve_precision(spec, device)
    pulse("joining the process group")
    join_process_group(device, spec.train.collective_timeout_s)
    pulse("loading the tokenizer")
    tokenizer = padding(AutoTokenizer.from_pretrained(spec.model, **hub_free(spec.model)), spec.model)
    tokenizer.model_max_length = spec.max_length  # the exported tokenizer truncates as training did
    pulse("loading the model")
    model = build_model(spec, tokenizer.pad_token_id)
    stages = spec.train.pipeline_parallel_size
    module, names = pipeline.stages(model, stages, spec.train.activation_checkpointing) if stages > 1 else (model, None)
    pulse("building the DeepSpeed engine")  # its first collective (broadcasting the weights) is NCCL's first connection
    cpu_probed_once()
    if spec.train.offload_optimizer and (lock := interrupted_build_cleared(CPU_ADAM)):
        say(spec.channel, logging.WARNING, f"removed {lock}: a DeepSpeed op build's lock an interrupted build left")
    engine, *_ = deepspeed.initialize(model=module, model_parameters=param_groups(module), config=spec.deepspeed)
    return engine, device, tokenizer, Replica(engine, spec.plan.accumulation, model.config, names)


def cpu_probed_once() -> None:
    """py-cpuinfo's get_cpu_info, kept after its first answer. It runs CPUID in a fresh subprocess (1.15 s
    here), and DeepSpeed asks it three times to load its CPU Adam op and once more per optimizer: 4.5 s
    of an offloaded worker's start, 1.1 s after this. Written here because neither library caches it,
    and the CPU under a process does not change."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def engine_line(engine, device: torch.device, seconds: float) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    every, trained = parameter_counts(engine.module)
    share = f", {trained / 1e6:.2f} M of {every / 1e6:.1f} M parameters trained" if trained < every else ""
    return (
        f"rank 0: engine built on {device} ({name}), {precision_of(engine)}, ZeRO-{engine.zero_optimization_stage()}"
        f"{share}, in {seconds:.1f} s"
    )
