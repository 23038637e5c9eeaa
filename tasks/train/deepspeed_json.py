"""The DeepSpeed JSON, derived from the typed config and the plan in this one place; the expert's
raw `train.deepspeed` keys merged over it."""

from __future__ import annotations

from tasks.core.train_config import TrainConfig
from tasks.train.spec import Plan


def merge(base: dict, override: dict) -> dict:
    """Deep merge: the expert's raw DeepSpeed keys win, nested sections are merged key by key."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = (
            merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def zero_config(cfg: TrainConfig, plan: Plan, hidden_size: int) -> dict:
    """The `zero_optimization` section: the stage, ZeRO-3's buffers, and what is offloaded."""
    zero: dict = {"stage": cfg.zero_stage, "stage3_gather_16bit_weights_on_model_save": True}
    if cfg.zero_stage == 3:
        # ZeRO-3 buffers sized to the model, as transformers' "auto" values do; DeepSpeed's defaults
        # are for billion-parameter models. Its default live/reuse limits (1e9 parameters) would keep
        # every gathered layer of a smaller model until backward, undoing the partitioning: allow
        # about one transformer layer (~12 hidden^2 parameters) instead.
        layer = 12 * hidden_size**2
        zero |= {
            "reduce_bucket_size": hidden_size**2,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size**2),
            "stage3_param_persistence_threshold": 10 * hidden_size,
            "stage3_max_live_parameters": layer,
            "stage3_max_reuse_distance": layer,
        }
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": plan.use_gpu}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": plan.use_gpu}
    return zero


def adam_config(cfg: TrainConfig) -> dict:
    """AdamW's parameters, and which implementation DeepSpeed builds."""
    adam = {"lr": cfg.learning_rate, "weight_decay": cfg.weight_decay}
    if cfg.offload_optimizer:
        adam["torch_adam"] = False  # offloaded state needs DeepSpeedCPUAdam
    else:
        # torch's fused AdamW: no JIT build, and no per-step temporaries (a fresh 90 MB `sqrt` of the
        # flat ZeRO partition page-faulted on every step): MiniLM's optimizer step 0.33 -> 0.15 s at
        # ZeRO-2, 0.15 -> 0.05 s at ZeRO-0, on CPU.
        adam |= {"torch_adam": True, "fused": True}
    return adam


def deepspeed_config(cfg: TrainConfig, plan: Plan, total_steps: int, hidden_size: int = 768) -> dict:
    """The DeepSpeed JSON, derived from the typed config in this one place."""
    warmup_steps = max(1, int(total_steps * cfg.warmup_ratio))  # DeepSpeed's schedulers need >= 1
    derived = {
        "train_batch_size": cfg.batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero_config(cfg, plan, hidden_size),
        # DeepSpeed's bf16 overflow check reads the gradient norm on the host every step, a device sync that
        # stops the host queueing the next step's kernels: ZeRO-2 at batch 256 on an H200 trained at 2,269
        # samples/s with it, 3,131 without (bench/RESULTS.md, 2026-11-30). bf16 has fp32's range and no loss
        # scale to guard; a loss that is no longer finite fails the run at its next log (worker.py's Meter).
        "bf16": {"enabled": plan.precision == "bf16", "check_grad_overflow": False},
        "fp16": {"enabled": plan.precision == "fp16"},
        "optimizer": {"type": "AdamW", "params": adam_config(cfg)},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": cfg.learning_rate,
                "warmup_num_steps": warmup_steps,
                "total_num_steps": max(total_steps, warmup_steps + 1),
                "warmup_type": "linear",
            },
        },
        "steps_per_print": 10**9,
        # DeepSpeed's throughput timer synchronizes the device at every forward and every step by
        # default: the host then waits for the GPU instead of queueing the next kernels. ftflow
        # measures its own samples/s (tasks/train/worker.py's Meter) without a sync per step.
        "timers": {"throughput": {"enabled": False}},
    }
    if cfg.tensor_parallel_size > 1:
        derived["tensor_parallel"] = {"autotp_size": cfg.tensor_parallel_size}
    if cfg.model_parallel > 1:
        # DeepSpeed 0.19.8 checks train_batch_size against micro-batch x accumulation x ranks where
        # it builds an AutoTP engine, against data-parallel ranks alone where ZeRO-3 partitions
        # AutoTP's new layers (zero.Init) and where it builds a pipeline engine: no value passes
        # them all, and ftflow's replicas join their ranks' micro-batches anyway. Left out, each
        # check derives it from the other two.
        del derived["train_batch_size"]
    return merge(derived, cfg.deepspeed)
