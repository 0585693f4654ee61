"""The configuration of ``dflash train``: its typed options, by section, and which of them a resumed run
may change (each section declares it; train/resume_contract.py applies it)."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from dflash_offline.config_fields import (
    CACHE,
    GPUS,
    PROGRESS,
    SEED,
    THREADS,
    WORKERS,
    OptionField,
    check_fields,
    cli_field,
    field_ref,
    from_options,
    option_fields,
    replace_options,
    section_class,
)
from dflash_offline.drafter_shape import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_LAYERS,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
)
from dflash_offline.errors import ConfigError
from dflash_offline.placement import parse_gpus


class Rule(enum.Enum):
    """What a resume may do with one ``dflash train`` option (or a field of the resume contract). Each
    section of ``TrainConfig`` declares the rule of its options (``RESUME_RULE``)."""

    FIXED = "refused when it differs"
    TOPOLOGY = "differs only where the invocation allows a topology change"
    APPLIED = "taken from this invocation, announced"
    FREE = "taken from this invocation, unchecked"


RESUME_KEY = "resume"
"""The ``dataclasses.field`` metadata key holding an option's own ``Rule``, where it overrides its
section's (``on_resume(Rule....)``, with a comment saying why the option is not moved)."""
ABSENT_KEY = "absent"
"""The metadata key holding what a config.json written before the option existed means by its absence."""


_NOT_NEWER = object()
"""``on_resume``'s ``absent`` when every run's config.json holds the option."""


def on_resume(rule: Rule | None = None, *, absent: Any = _NOT_NEWER) -> dict[str, Any]:
    """The metadata of an option: for an option newer than some runs' config.json, ``absent=`` the value
    that means what those runs did (not today's default); ``rule`` only where the option's resume rule is
    not its section's."""
    meta: dict[str, Any] = {} if rule is None else {RESUME_KEY: rule}
    return meta if absent is _NOT_NEWER else {**meta, ABSENT_KEY: absent}


def resume_rule(section: type[Any], f: Field[Any]) -> Rule:
    """The resume rule of the option ``f`` of ``section``: its own override, else the section's
    ``RESUME_RULE`` (``ValueError`` naming the section if it declares none)."""
    rule = f.metadata.get(RESUME_KEY, getattr(section, "RESUME_RULE", None))
    if not isinstance(rule, Rule):
        raise ValueError(
            f"{section.__name__} declares no resume rule: give it RESUME_RULE: ClassVar[Rule] = Rule...."
        )
    return rule


# ─── The options ────────────────────────────────────────────────────────────────────────────────────────────
# The typed configuration of ``dflash train``, one section per concern; the resume rule of a section's options
# is the section's ``RESUME_RULE`` (a reader learns it from the class), so an option sits in the section whose
# rule it has. Each field with a ``cli_field`` is a ``dflash train`` option: its default, type and help live
# here and nowhere else (``cli/options.py:config_options`` derives the click option). Option names are unique
# across sections: the command line is flat and builds the sections from it (``from_options``).


@dataclass(frozen=True, slots=True)
class MicrobatchLayout:
    """How a step's tokens are cut into microbatches when ``--grad-accum`` and ``--tokens-per-microbatch``
    are left to their default (0): one large microbatch a step on GPUs, four smaller ones on CPU workers."""

    grad_accum: int
    tokens_per_microbatch: int


GPU_LAYOUT = MicrobatchLayout(grad_accum=1, tokens_per_microbatch=32768)
"""On a GPU the step is host-bound (Python, autograd and kernel launches per microbatch): one microbatch of
32k tokens and 2,048 blocks trains the same tokens and blocks a step as four of 8k and 512 in half the time
at SmolLM2 width on an H200 (1.93× the tokens/s, side by side) and as fast at Qwen3-8B width (0.99×, with
58.5 against 34.5 GiB at peak); bench/RESULTS.md, "Training step"."""

CPU_LAYOUT = MicrobatchLayout(grad_accum=4, tokens_per_microbatch=8192)
"""On CPU workers the step is compute-bound and the dense attention grows with the square of a
microbatch's tokens: the larger microbatch ran 0.46× the tokens/s on the development CPU."""

TOKENS_PER_ANCHOR = 16
"""``--num-anchors`` left to its default (0): one block per this many tokens of ``--tokens-per-microbatch``
(512 for 8,192, 2,048 for 32,768)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterTrainConfig:
    """The drafter's tensors and its loss: its shape, the target whose embedding and head it uses, where its
    weights start and the loss decay (docs/drafter.md#defaults). A resume that asks for other values is
    refused: the checkpoint holds tensors of this shape, trained on this loss.

    Named apart from ``drafter/config.py:DrafterConfig``, the model's own (built from these and the cache)."""

    RESUME_RULE: ClassVar[Rule] = Rule.FIXED

    target: str | None = cli_field(
        None,
        help="Target for the frozen embedding and LM head (default: the cache's, when it is "
        "`default` or random:<preset>).",
    )
    """Where the frozen embedding and LM head come from; None = the cache's target when it is
    ``default`` or ``random:<preset>`` (a model directory must be named again: the cache stores
    only its name)."""
    num_layers: int = cli_field(DEFAULT_NUM_LAYERS, min=1, max=64)
    block_size: int = cli_field(
        DEFAULT_BLOCK_SIZE,
        min=MIN_BLOCK_SIZE,
        max=MAX_BLOCK_SIZE,
        why="a block is drafted in one forward and its attention grows with num_anchors × block_size; "
        "DFlash uses 8–16",
    )
    gamma: float | None = cli_field(
        None,
        min=0,
        min_open=True,
        help="Loss decay γ (default: 7 for B=16, 5 for 10, 4 for 8).",
    )
    """Loss decay; None = 7 for B=16, 5 for B=10, 4 for B=8."""
    mask_token_id: int | None = cli_field(None, min=0)
    feature_scale: Literal["none", "layer", "dim"] = cli_field(
        "dim",
        help="Fixed multiplier on the features before fc from cache statistics: 1/RMS per dimension or "
        "per captured layer (against massive activations), or none; folded into fc.weight at export.",
        metadata=on_resume(absent="none"),
    )
    """A fixed multiplier on the features before fc, from cache statistics (train/prepare.py):
    1/RMS per feature dimension (dim) or per captured layer (layer); folded into fc.weight at export.
    The default with ``final_norm_init`` 0.1 since an H200 run on one cache and one validation split
    at equal steps: validation chain τ 1.99 against 1.69 for none with 1.0 (bench/RESULTS.md,
    "Training recipe")."""
    final_norm_init: float = cli_field(
        0.1,
        min=0,
        min_open=True,
        help="Initial weight of the drafter's final RMSNorm (small: the untrained drafter's logits start "
        "near uniform instead of confidently wrong; first loss ≈ ln V instead of ≈ 72 on SmolLM2).",
        # FREE in a FIXED section: read only when a fresh run initialises the weights (a resume takes the
        # checkpoint's), so it may differ on resume; it stays beside the drafter it initialises.
        metadata=on_resume(Rule.FREE, absent=1.0),
    )
    """Initial value of every weight of the drafter's final RMSNorm. With a tied head of row norm ~3
    (SmolLM2), a unit-RMS hidden of width 576 gives logits spread over tens of units, so the untrained
    drafter is confidently wrong (first loss ≈ 72 ≫ ln V); a small value starts it near ln V."""
    init_from: Path | None = cli_field(
        None,
        path="dir",
        help="Start from the weights of an exported drafter (an earlier run's OUT/drafter, or a z-lab DFlash "
        "drafter) instead of random ones: its shape must be this run's (layers, block size, the cache's "
        "target layers, the target's sizes, mask token); --final-norm-init does not apply, the optimizer and "
        "LR schedule start afresh, and dflash eval also holds out what that drafter's own run trained on.",
        metadata=on_resume(absent=None),
    )
    """An export whose weights a fresh run starts from (``model_setup.init_weights_from``; a resume takes
    the checkpoint's). Stored absolute, so that ``dflash eval`` finds that drafter's run from anywhere
    (eval/prompts.py: held out from both runs' training samples)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Which samples a run trains on and holds out, and in which order and microbatches: the
    validation split and the training subset (train/snapshot.py), and the seed and token budget from which the
    sample plan is a pure function (train/planner.py). A resume that asks for other values is refused: the
    checkpoint's plan is a position in this order (its planner state records the seed and budget)."""

    RESUME_RULE: ClassVar[Rule] = Rule.FIXED

    seed: int = cli_field(0, cli=SEED)
    tokens_per_microbatch: int = cli_field(
        0,
        min=0,
        max=1 << 24,
        help=f"Tokens packed into one microbatch (default 0: {GPU_LAYOUT.tokens_per_microbatch} on GPUs, "
        f"{CPU_LAYOUT.tokens_per_microbatch} on CPU workers).",
    )
    """0 = by device, ``GPU_LAYOUT`` or ``CPU_LAYOUT``, resolved when the config is built."""
    num_anchors: int = cli_field(
        0,
        min=0,
        max=65536,
        help=f"Blocks per microbatch row (default 0: one per {TOKENS_PER_ANCHOR} tokens of "
        "--tokens-per-microbatch).",
    )
    """Anchors per microbatch row (the packed row is one 'sequence'); 0 = ``tokens_per_microbatch //
    TOKENS_PER_ANCHOR``, resolved when the config is built."""
    val_fraction: float = cli_field(
        0.02,
        min=0,
        max=1,
        max_open=True,
        help="Hold out this fraction of the cache's samples (chosen by a hash of the sample id: the same "
        "ones on every resume and world size) for validation; 0: none. With --follow: generate's "
        "--val-fraction, whose validation stores (whole conversations) are held out.",
    )
    """Share of the samples held out for validation (train/snapshot.py); 0 turns validation off."""
    val_samples: int | None = cli_field(
        None,
        min=1,
        help="Hold out this many samples instead of --val-fraction (those of smallest hash).",
    )
    """Hold out exactly this many samples (the smallest hashes) instead of ``val_fraction``."""
    val_group: Literal["sample", "root-id"] = cli_field(
        "sample",
        help="What is held out together: each sample alone, or (root-id) every record of one conversation "
        "(ShareGPT's X_0, X_11, … share the root X; read from the data file the cache was generated from). "
        "Not consulted with --follow: generate routed whole conversations.",
    )
    """``sample``: each sample is its own group; ``root-id``: the records of one conversation are held out
    (or trained on) together (train/snapshot.py)."""
    train_samples: int | None = cli_field(
        None,
        min=1,
        help="Train on N of the samples not held out for validation (default: all): those of smallest hash "
        "of the sample id (with --val-group root-id, of the conversation root: whole conversations, so at "
        "least N). The validation split does not depend on N; the same N takes the same samples on every "
        "resume and world size, and a larger N a superset of a smaller N's (nested data-scaling runs).",
        metadata=on_resume(absent=None),
    )
    """Train on this many of the samples not held out (train/snapshot.py: the smallest training keys, whole
    groups); None: all of them. More than there are is refused."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TopologyConfig:
    """How a rank's share of a step is cut: ``grad_accum`` microbatches per rank, so a step
    draws ``grad_accum`` × world size microbatches (the world size is ``LaunchConfig``'s ``gpus`` or
    ``num_cpu_workers``, or torchrun's). A resume changes either only with ``allow_topology_change``: the
    planner then plans the rest of the interrupted epoch over its remaining samples.

    Its own section: the one option whose rule is ``TOPOLOGY`` (the world size is the launch's, compared as
    the ranks, not as options)."""

    RESUME_RULE: ClassVar[Rule] = Rule.TOPOLOGY

    grad_accum: int = cli_field(
        0,
        min=0,
        help=f"Microbatches per GPU and step (a step mixes grad-accum × GPUs microbatches of all lengths; "
        f"default 0: {GPU_LAYOUT.grad_accum} on GPUs, {CPU_LAYOUT.grad_accum} on CPU workers).",
    )
    """Microbatches per rank and step: a step draws grad_accum × world_size microbatches across
    buckets, so with one GPU and grad_accum 1 each step holds a single length bucket (the buckets still
    take turns in proportion to their tokens, train/planner.py). 0 = by device, ``GPU_LAYOUT`` or
    ``CPU_LAYOUT``, resolved when the config is built."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer's hyper-parameters and the run's length: a resume takes them from the
    command line, announcing each change (the LR schedule is recomputed from them)."""

    RESUME_RULE: ClassVar[Rule] = Rule.APPLIED

    algorithm: Literal["adamw", "sgd"] = cli_field(
        "adamw",
        flag="--optimizer",
        # FIXED in an APPLIED section: the optimizer state a checkpoint holds is this algorithm's, so it
        # cannot change on resume; it stays beside the hyper-parameters it takes.
        metadata=on_resume(Rule.FIXED),
    )
    """AdamW (fp32 master weights) by default; plain SGD makes gradients comparable across topologies
    (Adam's per-element normalisation amplifies float summation noise on near-zero gradients)."""
    lr: float = cli_field(6e-4, min=0, min_open=True)
    weight_decay: float = cli_field(0.0, min=0)
    warmup_ratio: float = cli_field(0.04, min=0, max=1, max_open=True)
    grad_clip: float = cli_field(1.0, min=0, min_open=True)
    epochs: int = cli_field(6, min=1)
    max_steps: int | None = cli_field(
        None,
        min=1,
        help="Stop after this many optimizer steps (or at the end of --epochs, whichever is first).",
    )
    """Stop after this many optimizer steps, or at the end of ``epochs``: whichever comes first."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationConfig:
    """When validation runs and what it measures, and when it stops the run: a resume takes
    them from the command line, announcing each change. Which samples are held out is ``DataConfig``'s."""

    RESUME_RULE: ClassVar[Rule] = Rule.APPLIED

    val_every: int = cli_field(
        200,
        min=1,
        help="Validate every N steps and at the end: loss, accuracy per position, simulated, per-block and "
        "chain τ; OUT/drafter is the export of the best validation chain τ, OUT/drafter-last the last "
        "weights.",
    )
    val_chain_tokens: int = cli_field(
        256,
        min=1,
        help="Validation chain τ (the best export's and --early-stop's criterion) walks `dflash eval`'s "
        "draft-verify cycles over the first N answer tokens of every assistant turn: as "
        "`dflash eval --max-new-tokens N` decodes them.",
    )
    """Answer tokens per assistant turn that ``val_chain_tau`` covers (train/validation.py): eval's
    ``--max-new-tokens`` for the τ to compare with ``dflash eval``'s."""
    early_stop: int | None = cli_field(
        None,
        min=1,
        help="Stop (checkpointed, a clean end) after K validations without a better validation chain τ.",
    )
    """Stop after this many validations in a row without a better validation chain τ (a clean end)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """When the run checkpoints and exports, and whether it resumes: a resume takes these as
    given."""

    RESUME_RULE: ClassVar[Rule] = Rule.FREE

    checkpoint_every: int = cli_field(500, min=1)
    keep_checkpoints: int = cli_field(2, min=1)
    resume: Literal["auto", "never"] = cli_field(
        "auto",
        help="auto: continue from the newest checkpoint in --out, if any.",
    )
    allow_topology_change: bool = cli_field(
        False,
        help="Resume with another world size / grad accumulation (the epoch is re-planned).",
    )
    """Resume even though the world size or grad_accum differs from the checkpoint's
    (train/resume_contract.py decides; the planner re-plans the rest of the epoch)."""
    export_initial: bool = cli_field(
        False,
        help="Also export the untrained drafter to OUT/drafter-initial (a baseline for dflash eval).",
    )
    """Also export the untrained drafter to RUN/drafter-initial (the baseline for eval)."""
    export_at_end: bool = field(default=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """How the run executes: the devices and worker processes, the kernels (autocast, attention,
    compile, determinism), the packing of a rank's microbatches and the reading of the cache. None changes
    which tensors are trained on which samples, so a resume takes them as given (the ranks are compared as the
    world size: ``TopologyConfig``)."""

    RESUME_RULE: ClassVar[Rule] = Rule.FREE

    gpus: tuple[int, ...] = cli_field((), cli=GPUS, parse=parse_gpus)
    num_cpu_workers: int = cli_field(1, cli=WORKERS)
    threads_per_worker: int = cli_field(0, cli=THREADS)
    deterministic: bool = cli_field(False, help="Deterministic kernels (same loss curve across runs).")
    autocast: Literal["auto", "bf16", "off"] = cli_field(
        "auto",
        help="bf16 autocast of the forward: auto = on GPUs only (measure before using it on a CPU).",
    )
    """bf16 autocast of the forward (weights stay fp32): auto = on CUDA only. On the 2-core
    development CPU a SmolLM2-width step took 6.0 s with bf16 against 2.2 s in float32."""
    attention: Literal["auto", "flex", "sdpa"] = cli_field("auto")
    compile: Literal["auto", "on", "off"] = cli_field(
        "auto",
        help="torch.compile the drafter's layers around attention (fused kernels; numbers close to, not "
        "equal to, eager ones): auto = on GPUs (1.23–1.29× a training step's tokens/s on an H200, "
        "bench/train_step.py), off on a CPU and under --deterministic (its loss curve stays eager's).",
    )
    """torch.compile of the drafter's per-layer work around attention (``DFlashDrafter.compile_training``),
    resolved by ``train/prepare.py:compiles``: auto = on CUDA unless ``deterministic``. On one H200 a training
    step made 1.29× the tokens/s at SmolLM2 width and 1.23× at Qwen3-8B width, in less memory
    (docs/facts.md, "Training throughput"). Off on the CPU: nothing measured says it helps there. Off by
    default under ``deterministic``: a deterministic run keeps the eager loss curve it had before compile
    became the default (``on`` still compiles it). An older run's config.json holds true/false
    (``from_dict`` reads them as on/off)."""
    fuse_microbatches: bool = cli_field(
        False,
        help="Pack this GPU's --grad-accum microbatches of a step into one row: one forward of their tokens "
        "and blocks (--num-anchors each), their length buckets mixed within the step.",
    )
    """One forward of a rank's microbatches of a step, packed one after the other (``microbatch.fuse_step``):
    the step of ``--grad-accum 4 --tokens-per-microbatch 8192 --fuse-microbatches`` has the tokens, blocks
    and shapes of ``--grad-accum 1 --tokens-per-microbatch 32768`` (so its speed on a GPU) while each step
    still draws from every bucket, as several microbatches do. Documents never attend to each other within
    a row, so a fused row trains as its microbatches would, up to the anchors drawn (one draw over the row,
    seeded by its samples). Not measured on a GPU yet: off by default."""
    prefetch: int = cli_field(4, min=1, max=1024, help="Microbatches prepared ahead.")
    loader_threads: int = cli_field(4, min=1, max=256)
    on_damaged: Literal["stop", "skip"] = cli_field(
        "stop",
        help="A damaged sample when read (a missing or truncated shard file, a chunk that does not decode, a "
        "zarr.json unlike the writer's, a failed checksum): stop naming it, or skip it (recorded in "
        "RUN/damaged_samples.jsonl, reported at the end).",
    )
    """A sample failing its crc32c when read: ``stop`` the run naming it, or ``skip`` it (recorded in
    RUN/damaged_samples.jsonl, announced at the end)."""

    @property
    def world_size(self) -> int:
        """Ranks of the run: one per GPU, else the CPU workers."""
        return len(self.gpus) if self.gpus else self.num_cpu_workers


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    """What the run reports as it goes: metrics, TensorBoard event files, the progress bar. A
    resume takes these as given.

    Apart from ``LaunchConfig``: these change what the run writes for a reader, not how it runs."""

    RESUME_RULE: ClassVar[Rule] = Rule.FREE

    log_every: int = cli_field(
        1,
        min=1,
        help="Write metrics every N steps (and at validation and the last step); reading them back from "
        "a GPU waits for it, so a large N lets the host run ahead.",
    )
    """Metrics are read back from the device (a host sync) and written every ``log_every`` steps, at
    every validation and at the last step; in between they stay on the device."""
    tensorboard_dir: Path | None = cli_field(
        None,
        flag="--tensorboard",
        path="dir",
        help="Write TensorBoard event files to DIR (default: OUT/tb when the tensorboard package is "
        "installed: pip install 'dflash-offline[tensorboard]').",
    )
    """Explicit event-file directory (``--tensorboard DIR``): then the package is required."""
    tensorboard: bool = cli_field(
        True,
        flag="--no-tensorboard",
        negate=True,
        help="Write no TensorBoard event files.",
    )
    """Write TensorBoard event files: to ``tensorboard_dir``, else to RUN/tb when the package is there."""
    progress: bool = cli_field(True, cli=PROGRESS)


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowConfig:
    """Training on a cache that ``dflash generate`` is still filling within its disk window (``follow``,
    train/follow.py, docs/follow.md). A resume takes these as given: follow.json holds a follow run's passes
    and refuses another value, and a follow run's segments are plain runs.

    Apart from the others: a mode of the whole run (``dflash train`` then runs train/follow.py, which trains
    each segment as a plain run)."""

    RESUME_RULE: ClassVar[Rule] = Rule.FREE

    follow: bool = cli_field(
        False,
        help="Train on a cache that `dflash generate --window-limit` is still filling: train each batch of "
        "sealed stores for --passes epochs as it arrives, retire (delete) the stores whose samples had their "
        "passes once a checkpoint records it, and end once the generate run finished and every store was "
        "trained (docs/follow.md).",
        metadata=on_resume(absent=False),
    )
    """Follow a disk window (``train/follow.py``): segments of sealed stores, each trained ``passes``
    epochs in RUN/segments/<k>, then retired."""
    passes: int = cli_field(
        2,
        min=1,
        help="With --follow: epochs over each sample before its store is retired. Default 2: training runs "
        "about 2.3x the tokens/s of generate on one H100 (fp8, SmolLM2), so two passes keep both busy.",
        metadata=on_resume(absent=2),
    )
    """Passes over every sample under ``follow``: 2 by default, since training's tokens/s is about 2.3×
    generate's on one H100 (docs/follow.md): more passes leave generate waiting, fewer leave training idle."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything one training run needs, by section (``config.optimizer.lr``); saved as ``RUN/config.json``.
    Its own fields are the run's places on disk and a record of its layout, which a resume takes as given."""

    RESUME_RULE: ClassVar[Rule] = Rule.FREE

    cache_dir: Path = cli_field(
        cli=CACHE,
        help="Cache written by `dflash generate` (a run still writing is fine: its committed samples).",
    )
    out_dir: Path = cli_field(
        flag="--out",
        path="dir",
        required=True,
        help="Run directory: config, snapshot, metrics.jsonl, checkpoints/, drafter/ (the export).",
    )
    drafter: DrafterTrainConfig = field(default_factory=DrafterTrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    window: WindowConfig = field(default_factory=WindowConfig)
    layout_by_device: tuple[str, ...] = field(default=())
    """The fields of grad_accum, tokens_per_microbatch and num_anchors that were left to the device's
    default (0) and resolved here: a resume takes the run's own values for those instead (a run started
    before the default changed, or on another kind of device, continues as it began)."""

    def _check_out_beside_cache(self) -> None:
        """--out inside the cache would mix the run's files (and its ``lock``) into the cache's."""
        cache, out = Path(self.cache_dir).resolve(), Path(self.out_dir).resolve()
        if out == cache or cache in out.parents:
            out_flag = field_ref(TrainConfig, "out_dir")
            raise ConfigError(
                f"{out_flag} {self.out_dir} is inside {field_ref(CACHE)} {self.cache_dir}: the run "
                f"directory and the cache would share files (both hold a `lock`); choose an {out_flag} "
                "outside the cache"
            )

    def _resolve_layout(self) -> None:
        """Replace the 0 (by device) of grad_accum, tokens_per_microbatch and num_anchors by values, so that
        config.json, the resume contract and every reader see numbers."""
        layout = GPU_LAYOUT if self.launch.gpus else CPU_LAYOUT
        data, topology = self.data, self.topology
        by_device = tuple(
            name
            for name, value in (
                ("grad_accum", topology.grad_accum),
                ("tokens_per_microbatch", data.tokens_per_microbatch),
                ("num_anchors", data.num_anchors),
            )
            if value == 0
        )
        if by_device:
            object.__setattr__(self, "layout_by_device", by_device)
        if topology.grad_accum == 0:
            object.__setattr__(self, "topology", replace(topology, grad_accum=layout.grad_accum))
        if data.tokens_per_microbatch == 0:
            data = replace(data, tokens_per_microbatch=layout.tokens_per_microbatch)
        if data.tokens_per_microbatch == 1:
            raise ConfigError(
                f"{field_ref(DataConfig, 'tokens_per_microbatch')} 1: a microbatch needs an anchor "
                "and the token it drafts (≥ 2; 0 = the device's default)"
            )
        if data.num_anchors == 0:
            data = replace(data, num_anchors=max(1, data.tokens_per_microbatch // TOKENS_PER_ANCHOR))
        object.__setattr__(self, "data", data)

    def __post_init__(self) -> None:
        self._resolve_layout()
        check_fields(self)  # every section's options, in one message (a section does not check itself)
        self._check_out_beside_cache()
        init_from = self.drafter.init_from
        if init_from is not None and not init_from.is_absolute():
            object.__setattr__(
                self, "drafter", replace(self.drafter, init_from=Path(os.path.abspath(init_from)))
            )
        if self.logging.tensorboard_dir is not None:
            tensorboard_dir = field_ref(LoggingConfig, "tensorboard_dir")
            if not self.logging.tensorboard:
                raise ConfigError(
                    f"{tensorboard_dir} DIR and {field_ref(LoggingConfig, 'tensorboard')} contradict "
                    "each other: give one"
                )
            from dflash_offline.tensorboard import require_tensorboard

            require_tensorboard(tensorboard_dir)

    @classmethod
    def from_options(cls, **options: Any) -> TrainConfig:
        """The config of these options, each by its name (as the command line has them: ``lr=0.1``), each
        put in its section; the others keep their defaults."""
        config: TrainConfig = from_options(cls, options)
        return config

    def with_options(self, **options: Any) -> TrainConfig:
        """This config with these options changed, each by its name (``max_steps=6``)."""
        config: TrainConfig = replace_options(self, options)
        return config

    def resolved_tensorboard_dir(self) -> Path | None:
        """Where event files go: the explicit directory, RUN/tb when tensorboard is installed, or None."""
        from dflash_offline.tensorboard import tensorboard_available

        if not self.logging.tensorboard:
            return None
        if self.logging.tensorboard_dir is not None:
            return self.logging.tensorboard_dir
        return self.out_dir / "tb" if tensorboard_available() else None

    def to_dict(self) -> dict[str, Any]:
        """``RUN/config.json``: the run's own fields, one object per section (format ``CONFIG_VERSION``)."""
        d: dict[str, Any] = {"version": CONFIG_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in SECTIONS:
                d[f.name] = {g.name: _json_value(getattr(value, g.name)) for g in fields(value)}
            else:
                d[f.name] = _json_value(value)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """A run's config.json, as this version writes it (by section) or as versions before it did (flat)."""
        saved = saved_options(d)
        unknown = set(saved) - set(OPTIONS)
        if unknown:
            raise ConfigError(f"run config has unknown fields {sorted(unknown)}: written by another version?")
        values = {**OPTIONS_ADDED_SINCE, **saved}
        for name in ("cache_dir", "out_dir", "tensorboard_dir", "init_from"):
            if values.get(name) is not None:
                values[name] = Path(values[name])
        for name in ("gpus", "layout_by_device"):
            values[name] = tuple(values.get(name, ()))
        if isinstance(values.get("compile"), bool):  # written before compile took auto/on/off
            values["compile"] = "on" if values["compile"] else "off"
        return cls.from_options(**values)


CONFIG_VERSION = 2
"""The layout of ``RUN/config.json``: 2 by section; 1 (no ``version`` key) one flat object of options, which
``saved_options`` still reads."""

SECTIONS: Mapping[str, type[Any]] = {
    f.name: section for f in fields(TrainConfig) if (section := section_class(f)) is not None
}
"""``TrainConfig``'s sections: attribute name → class."""

OPTIONS: Mapping[str, OptionField] = {o.name: o for o in option_fields(TrainConfig)}
"""Every option of ``TrainConfig`` (its own fields and its sections'), by name, in declaration order."""

OPTION_RULES: Mapping[str, Rule] = {name: resume_rule(o.owner, o.field) for name, o in OPTIONS.items()}
"""What a resume may do with each option: its section's rule (or its own override)."""

OPTIONS_ADDED_SINCE: Mapping[str, Any] = {
    name: o.field.metadata[ABSENT_KEY] for name, o in OPTIONS.items() if ABSENT_KEY in o.field.metadata
}
"""Options newer than some runs' config.json, each by the value that means what those runs did (every sample
not held out trained on; features fed to fc unscaled; the final norm's weight initialised to 1.0, the
defaults before the recipe change; random initial weights; no follow run): a run read back (resume, export)
gets these, not today's defaults. Each option declares it (``on_resume(absent=)``)."""

_FLAT_NAMES: Mapping[str, str] = {"optimizer": "algorithm"}
"""Options a flat config.json (format 1) names otherwise: its name → today's."""


def saved_options(d: Any) -> dict[str, Any]:
    """Option name → value (as JSON holds it) of a run's config.json, written by section (format 2) or flat
    (format 1, before the sections); ``ConfigError`` for anything but an object of a format this version
    reads. Names are not checked (``TrainConfig.from_dict`` refuses unknown ones)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"run config is {type(d).__name__}, not an object")
    version = d.get("version", 1)
    if version == 1:
        flat = {_FLAT_NAMES.get(name, name): value for name, value in d.items()}
    elif version == CONFIG_VERSION:
        flat = {}
        for name, value in d.items():
            if name in SECTIONS and isinstance(value, Mapping):
                flat.update(value)
            elif name != "version":
                flat[name] = value
    else:
        raise ConfigError(
            f"run config has format version {version!r}; this dflash-offline reads 1 and {CONFIG_VERSION}: "
            "written by another version?"
        )
    return flat


def _json_value(value: Any) -> Any:
    """An option's value as config.json holds it: a path as text, a tuple as a list."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value
