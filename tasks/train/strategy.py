"""`strategy: auto`: the fastest training strategy whose memory fits a worker.

The candidates go fastest first, as bench/RESULTS.md measured them (all-MiniLM-L6-v2, 2 CPU workers
of 1 thread, samples/s): ZeRO-0 58.9, tensor parallel x2 55.4, 2 pipeline stages 55.1, ZeRO-1 42.1,
ZeRO-2 (0.94x ZeRO-1 in an earlier run), ZeRO-3 24.1, ZeRO-3 with offload 24.0. Then, unmeasured and
so last, splits of 2 on top of the most memory-saving ZeRO stage each takes, and splits of 4 and 8.
Offload moves state to host memory, which a GPU worker has beside its own and a CPU worker does not,
so it is a candidate on GPUs only. The order is measured on CPUs; on GPUs the links between them
decide what tensor parallelism costs (not measured here).

A candidate's need per worker = model states (DeepSpeed's estimators) + activations + the process.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.contracts.training import Choice
from tasks.core.models import adapts, layers_of, linear_layers, meta_classifier
from tasks.core.train_config import AUTO_CHOOSES, Lora, TrainConfig

GIB = 2**30
# What a CPU worker holds before its model: Python, torch, transformers, DeepSpeed and Ray's worker
# (RSS of a tiny-model worker, whose model is ~1 MB: 0.65 GiB at its peak). A GPU's memory holds
# none of it.
CPU_PROCESS_BYTES = int(0.65 * GIB)

ZERO = [{"zero_stage": stage} for stage in range(4)]
SPLITS = (2, 4, 8)  # tensor-parallel and pipeline sizes tried
OFFLOAD = [
    {"zero_stage": 3, "offload_optimizer": True},
    {"zero_stage": 3, "offload_optimizer": True, "offload_params": True},
]


@dataclass(frozen=True)
class ModelSize:
    params: int
    layer_params: int  # in the encoder or decoder layers: what tensor parallelism splits
    largest_layer: int  # the most parameters of one module: what ZeRO-3 gathers at once
    hidden: int
    heads: int
    kv_heads: int  # key and value heads: fewer than heads under grouped-query attention
    layers: int
    intermediate: int
    gated: bool  # a gated feed-forward (gate and up projections, as Llama's SwiGLU): 2 matrices in, not 1
    linears: tuple[tuple[str, int, int], ...]  # each linear layer but the head: name, in and out features (LoRA's)
    head_params: int  # the classifier's (classifier, score): what LoRA trains in full
    fused_attention: bool  # sdpa or flash attention: the scores are never kept whole (eager keeps them)

    @classmethod
    def of(cls, name_or_path: str, labels: int) -> ModelSize:
        """Counted on the model's structure, built without weights (meta device): no load."""
        model = meta_classifier(name_or_path, "single_label", labels)
        config, linears = model.config, linear_layers(model)
        head = getattr(model, "classifier", None) or getattr(model, "score", None)
        return cls(
            params=sum(p.numel() for p in model.parameters()),
            layer_params=sum(p.numel() for layer in layers_of(model) for p in layer.parameters()),
            largest_layer=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            layers=config.num_hidden_layers,
            intermediate=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            gated=any(name.endswith("gate_proj") for name, *_ in linears),
            linears=tuple(linears),
            head_params=sum(p.numel() for p in head.parameters()) if head is not None else 0,
            fused_attention=config._attn_implementation != "eager",
        )

    def adapted(self, lora: Lora) -> list[tuple[str, int, int]]:
        """The linear layers LoRA adapts."""
        return [linear for linear in self.linears if adapts(linear[0], lora.target_modules)]

    def lora_params(self, lora: Lora) -> int:
        """What LoRA trains: r x (in + out) for each adapted linear layer, and the head in full."""
        return lora.r * sum(inputs + outputs for _, inputs, outputs in self.adapted(lora)) + self.head_params

    def lora_activation_bytes(self, lora: Lora) -> int:
        """The bytes per token and layer peft's adapters add to what backward keeps, in fp32: each adapted
        layer's output once more, and with dropout each one's input dropped (a copy and its mask). Fitted
        in one process on a 99M-parameter Llama, 8 x 128 tokens: activations of 0.81 GiB fully fine-tuned,
        1.15 with LoRA, 1.66 with LoRA's dropout at 0.05."""
        adapted = self.adapted(lora)
        outputs, inputs = sum(o for *_, o in adapted), sum(i for _, i, _ in adapted)
        return (5 * outputs + (6 * inputs if lora.dropout else 0)) // max(1, self.layers)


# fp32 training's bytes per trained parameter, (held whole, sharded over the replicas) by ZeRO stage: the
# parameter 4, its gradient 4, DeepSpeed's fp32 copy of a ZeRO optimizer's partition 4 and Adam's two
# moments 8. ZeRO-0 steps the parameters themselves (no copy); ZeRO-3 shards everything (and gathers a
# layer at a time: largest_layer). ZeRO-1 and 2 hold more whole: measured on a 99M-parameter Llama
# at 2 workers (bench/estimates.py), they peaked 0.13-0.15 GiB above ZeRO-0, not below, as DeepSpeed
# flattens the parameters into a new buffer (the old storage stays in the worker's heap) and its
# gradient bucket (5e8 elements by default) takes a model's worth of gradients at a time; ZeRO-1 4 more
# again (its fp32 gradient accumulator), fitted at 0.45B parameters (bench/largest.py: 10.18 GiB peak).
FP32_BYTES = {0: (16, 0), 1: (16, 12), 2: (12, 16), 3: (0, 20)}
# ZeRO-0 over several replicas flattens the gradients for its all-reduce, a copy of them (a lone worker
# skips it: tasks/train/worker.py no_sync): 4 bytes a parameter more, measured on a 0.45B-parameter
# Llama at 2 workers (bench/largest.py: 9.45 GiB against 7.79 without them).
ALL_REDUCE_COPY = 4


def model_state_bytes(size: ModelSize, cfg: TrainConfig, workers: int, fp32: bool) -> int:
    """Parameters, gradients and optimizer state one worker holds on its device. 16-bit: DeepSpeed's
    estimators for ZeRO-2 and 3, and the same terms for ZeRO-0 and 1 (2 bytes per 16-bit parameter and
    gradient, 16 for the fp32 master weights and Adam moments, which ZeRO-1 shards). fp32 (CPUs train in it):
    FP32_BYTES. Tensor parallelism divides the layers by tp, pipeline stages the whole model by pp
    (about: the embeddings ride with the first), and the replicas ZeRO shards over by either. Under LoRA
    the frozen model costs its parameters alone (2 or 4 bytes), sharded by ZeRO-3 only."""
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    params = (size.params - size.layer_params + size.layer_params // tp) // pp
    replicas = max(1, workers // (tp * pp))
    trained = size.lora_params(cfg.lora) if cfg.lora else params
    frozen = params - size.head_params if cfg.lora else 0
    shards = replicas if cfg.zero_stage == 3 else 1
    if fp32:
        whole, sharded = FP32_BYTES[cfg.zero_stage]
        whole += ALL_REDUCE_COPY if cfg.zero_stage == 0 and replicas > 1 else 0
        gathered = 4 * size.largest_layer // tp if cfg.zero_stage == 3 else 0
        return whole * trained + sharded * trained // replicas + gathered + 4 * frozen // shards
    return trained_16bit_bytes(size, cfg, trained, replicas) + 2 * frozen // shards


def trained_16bit_bytes(size: ModelSize, cfg: TrainConfig, trained: int, replicas: int) -> int:
    """Mixed-precision training's model states (see model_state_bytes)."""
    # imported here: deepspeed probes the accelerator, and logs it, at import
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    stage, offload = cfg.zero_stage, cfg.offload_optimizer
    if stage == 3:
        largest = size.largest_layer // cfg.tensor_parallel_size
        return estimate_zero3_model_states_mem_needs(trained, largest, replicas, 1, offload, cfg.offload_params)[1]
    if stage == 2:
        return estimate_zero2_model_states_mem_needs(trained, replicas, 1, offload)[1]
    return 4 * trained + 16 * trained // (replicas if stage == 1 else 1)


def activation_bytes(size: ModelSize, micro_batch: int, seq: int, cfg: TrainConfig, fp32: bool) -> int:
    """Activations kept for backward: per layer s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes at 16 bits
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"), with its
    24*h split into the query and the attention's output (4h), the keys and values (4 x the key-value
    heads' width: less under grouped-query attention) and the feed-forward's intermediate (4 x its width,
    8 x for a gated one: gate, up, activation, product); doubled for fp32, which is what CPUs train in. A
    pipeline stage holds layers/pp layers, for up to pp micro-batches in flight (the first stage, in
    DeepSpeed's one-forward-one-backward schedule). Activation checkpointing keeps each layer's input
    (2*s*b*h) and one layer's whole at a time, recomputed. The attention scores (5*a*s per token) only
    where attention is eager: sdpa and flash attention keep none (bench/long_inputs.py: a 4,096-token
    batch peaked at 2.67 GiB, where keeping them would have taken 12)."""
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    s, b, h, a = seq, micro_batch, size.hidden, size.heads
    scores = 0 if size.fused_attention else 5 * a * s  # measured: sdpa on CPU keeps no s x s scores either
    split = 4 * h + 4 * h * size.kv_heads // a + (8 if size.gated else 4) * size.intermediate + scores
    # Llama-style layers keep more than the formula's GPT: their RMSNorms compute in fp32 and the rotary
    # embedding copies the queries and keys (6h more, fitted: a 99M Llama kept 0.81 GiB for 8 x 128 tokens)
    replicated = (16 if size.gated else 10) * h
    layer, layers = s * b * (replicated + split / tp), size.layers // pp
    kept = 2 * s * b * h * layers + layer if cfg.activation_checkpointing else layer * layers
    adapters = size.lora_activation_bytes(cfg.lora) * s * b * layers if cfg.lora else 0  # in fp32 already
    return int((2 if fp32 else 1) * pp * kept + adapters // (1 if fp32 else 2))


def candidates(cfg: TrainConfig, use_gpu: bool) -> list[TrainConfig]:
    """cfg as each strategy would train it (strategy=manual), fastest first (see above); pipelines with
    ZeRO-1 at most, all DeepSpeed's pipeline engine takes."""
    last = OFFLOAD[-1] if use_gpu else ZERO[-1]
    measured = [
        ZERO[0],
        {"zero_stage": 0, "tensor_parallel_size": 2},
        {"zero_stage": 0, "pipeline_parallel_size": 2},
        *ZERO[1:],
        *(OFFLOAD if use_gpu else []),
    ]
    settings = [
        *measured,
        *({**last, "tensor_parallel_size": size} for size in SPLITS),
        *({**ZERO[1], "pipeline_parallel_size": size} for size in SPLITS),
    ]
    return [
        cfg.model_copy(update={**chosen, "strategy": "manual", "memory_per_worker_gb": None}) for chosen in settings
    ]


def pick(options: list[tuple[TrainConfig, int, int]]) -> tuple[TrainConfig, Choice]:
    """The first of (candidate, bytes needed per worker, bytes each has), fastest first, that fits, and
    why; else a refusal that names the least need."""
    for index, (candidate, need, budget) in enumerate(options):
        if need <= budget:
            faster = ", ".join(f"{describe(c)} ~{n / GIB:.2f}" for c, n, _ in options[:index])
            reason = (
                f"{describe(candidate)} needs ~{need / GIB:.2f} GiB per worker of the {budget / GIB:.2f} GiB each has"
                + (f"; the faster need more ({faster})" if faster else ", and it is the fastest")
            )
            return candidate, Choice(
                settings=chosen(candidate),
                need_gb=round(need / GIB, 3),
                budget_gb=round(budget / GIB, 3),
                reason=reason,
            )
    candidate, need, budget = min(options, key=lambda option: option[1] - option[2])
    raise ValueError(
        f"train.strategy=auto: no strategy fits a worker; the closest, {describe(candidate)}, needs ~{need / GIB:.2f} GiB "
        f"per worker of the {budget / GIB:.2f} GiB each has: give workers more memory (train.memory_per_worker_gb, "
        "larger nodes), or shorten model.max_length or train.micro_batch_size"
    )


def chosen(cfg: TrainConfig) -> dict:
    """The fields strategy=auto sets that differ from their defaults, and the ZeRO stage always."""
    defaults = TrainConfig.model_fields
    return {"zero_stage": cfg.zero_stage} | {
        name: getattr(cfg, name) for name in AUTO_CHOOSES if getattr(cfg, name) != defaults[name].default
    }


def describe(cfg: TrainConfig) -> str:
    split = cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1
    words = [f"ZeRO-{cfg.zero_stage}" if cfg.zero_stage or split else "data parallel (ZeRO-0)"]
    if cfg.offload_params:
        words.append("parameter and optimizer offload")
    elif cfg.offload_optimizer:
        words.append("optimizer offload")
    if cfg.tensor_parallel_size > 1:
        words.append(f"tensor parallel x{cfg.tensor_parallel_size}")
    if cfg.pipeline_parallel_size > 1:
        words.append(f"{cfg.pipeline_parallel_size} pipeline stages")
    return " + ".join(words)


def memory_per_cpu(use_gpu: bool) -> float | None:
    """On CPUs, the memory a worker gets per CPU it takes: the least of any node's, as Ray counts its
    memory (its `memory` resource); None on GPUs, where a worker has its GPU's (gpu_memory)."""
    import ray

    if use_gpu:
        return None
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU")]
    if not nodes:  # a cluster at rest, its workers' nodes yet to come
        raise ValueError(
            "train.strategy=auto: no node with CPUs is up to read a worker's memory from: set train.memory_per_worker_gb"
        )
    return min(node.get("memory", 0) / node["CPU"] for node in nodes)


def gpu_memory() -> int:
    """A GPU's memory, read on a GPU node of the cluster (the driver may have none)."""
    import ray

    def total() -> int:
        import torch

        return torch.cuda.get_device_properties(0).total_memory

    return ray.get(ray.remote(num_gpus=1, num_cpus=0)(total).remote())


def need_bytes(size: ModelSize, cfg: TrainConfig, workers: int, micro_batch: int, seq: int, use_gpu: bool) -> int:
    """What one worker needs training as cfg says, planned as `workers` of `micro_batch` rows of `seq` tokens."""
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    # On CPUs, a tensor-parallel worker loads the model whole before the engine splits it (engine.py), and
    # its heap keeps the room: a 99M-parameter Llama's TP2 worker peaked as high as a ZeRO-0 one.
    process = 0 if use_gpu else CPU_PROCESS_BYTES + (4 * size.params if tp > 1 else 0)
    fp32 = cfg.precision == "fp32" or (cfg.precision == "auto" and not use_gpu)  # auto: bf16 or fp16 on a GPU
    # a replica's micro-batch is its ranks' together (tasks/train/worker.py Replica)
    activations = activation_bytes(size, micro_batch * tp * pp, seq, cfg, fp32)
    return model_state_bytes(size, cfg, workers, fp32) + activations + process
