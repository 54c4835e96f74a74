"""ndp under Hugging Face Accelerate: an ``Accelerator`` whose context parallelism is ndp's.

An Accelerate ND-parallel script (``ParallelismConfig`` + ``FullyShardedDataParallelPlugin(fsdp_version=2)`` +
``Accelerator`` + ``accelerator.prepare`` + ``accelerator.maybe_context_parallel(...)``) runs on ndp's CP when
``from accelerate import Accelerator`` becomes ``from ndp.accelerate import Accelerator``: ndp's CP attention
for every model family ndp serves (sliding windows, sinks, GQA without replication, Ulysses / USP), its
load-balanced sharding of the buffers (packed rows per document), the global mean loss, Accelerate's own
FSDP2, and TP (ndp's, where Accelerate would skip the model). It runs on CPU with gloo as well (Accelerate alone
refuses ND-parallel there).

:class:`Accelerator` subclasses ``accelerate.Accelerator`` and overrides, nothing else patched:

- ``__init__``: takes ndp's fields ``cp_impl``, ``ulysses_size``, ``cp_layout``, ``cp_mixers`` (else
  ``NDP_CP_IMPL``, ``NDP_ULYSSES_SIZE``, ``NDP_CP_LAYOUT``, ``NDP_CP_MIXERS`` from the environment, else ndp's
  defaults); on CPU it sets Accelerate's
  state to FSDP2 over gloo before Accelerate validates it.
- ``_prepare_tp`` (called by ``prepare`` for tp_size > 1, first): Accelerate's TP takes only a model transformers
  loaded sharded (DTensor parameters) and skips any other with a warning, tp_size dropped: every TP rank computed
  the whole model. A transformers model with plain parameters gets ndp's TP (its own plan, checked by
  ``ndp.hf.check_tp_plan``: refused by name where ndp cannot split it exactly), its optimizers moved onto the split
  parameters. A model transformers loaded sharded is refused by name: ndp neither checks transformers' split nor
  shares its dropout draws over the TP ranks, and Accelerate 1.15's TP preparation of it fails on transformers 5.24
  (``ReplicateParallel``, which it imports, is gone).
- ``_prepare_cp`` (called by ``prepare`` for cp_size > 1, after TP and before FSDP2): ndp's CP on each model
  (``ndp.hf.check_model``, attention switched to ``ndp_<cp_impl>``, the CP contexts), instead of torch's
  ``context_parallel`` hooks.
- ``_prepare_fsdp2``: after Accelerate's FSDP2, each MoE decoder layer's expert parameters are tied into its input
  (``ndp.parallel.parallelize.tie_experts``, as ndp's own FSDP2 does): an expert no token of a rank's shard reached
  still gets a (zero) gradient there, so every rank reduce-scatters the same parameters; the input embedding's unit
  stays gathered from its forward to its backward (Gemma 4 reads its weight outside the embedding's forward).
- ``prepare`` / ``prepare_model``: under FSDP2 a model without its optimizer (an evaluation before
  any training: the Trainer's ``evaluate`` or ``predict`` first), which Accelerate refuses, is prepared with a
  placeholder optimizer over its parameters (dropped after); when its optimizer comes later, with it or alone (the
  Trainer under ``torch_compile``), the model is not prepared again, only put back among the prepared ones.
- ``maybe_context_parallel``: refuses, on every rank, buffers that differ between the CP or TP ranks of a batch (under
  TP alone too: each rank would split another batch); under CP shards the buffers in place with ndp's layout (restored
  on exit unless listed in ``no_restore_buffers``, as Accelerate does) and, for the model's forward inside the block,
  passes the packed document table and ``num_items_in_batch``: the labelled tokens of the whole dp x cp batch over the
  ranks FSDP averages on, so the averaged gradients are those of the global mean loss.
- ``gather_for_metrics``: under CP or TP, gathered from the dp x cp ranks (a TP rank's entries are copies:
  Accelerate gathered each batch's once per TP rank), and the padded last evaluation step cut by data-parallel
  sample, every CP rank's entries of a real sample kept: a per-rank value (a 0-dim tensor: TRL's token counts and
  sums) or a per-sample tensor (Accelerate cuts the gathered entries one by one, as if each were a sample's).
  With ``whole_batch_metrics`` set (ndp.trainer's DPOTrainer and KTOTrainer: each CP rank holds its batch's whole
  values, copies), gathered from the data-parallel ranks only.
- ``prepare_data_loader``: with ``even_batches=False``, a loader whose batch counts differ between the ranks is
  refused on every rank (one all-reduce of the counts): the rank out of batches would leave the others waiting in
  their next collective, a hang (stock Accelerate hangs there too). A dispatching loader (``dispatch_batches``,
  Accelerate's default for an iterable dataset: process 0 reads) deals its batches by data-parallel rank
  (:class:`DataParallelDispatcher`; Accelerate's deals one piece per process, which gave the CP ranks of a batch
  different rows and, with TP beside data parallelism, every data-parallel rank process 0's piece).
- ``skip_first_batches``: a loader dealing by data-parallel rank stays so (Accelerate's rebuilds it as its own).
- ``prepare_cp`` (added): ndp's CP on a model prepared elsewhere (TRL shards a DPO / KTO reference model with FSDP2
  itself), once.
- ``prepare_tp`` (added): ndp's TP on such a model, before it is sharded (ndp.trainer gives TRL's reference model it
  before TRL's FSDP2: split as the policy is, not whole on every TP rank).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import accelerate
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate.data_loader import DataLoaderDispatcher
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import (OPTIMIZER_NAME, DistributedType, TorchDynamoPlugin, broadcast_object_list, concatenate,
                              get_data_structure, initialize_tensors, recursively_apply)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import ndp.hf
from ndp_kernels.segments import cu_from_starts, packed_rows_cu, position_restarts
from ndp.cp.sharding import seq_multiple
from ndp.hf.batch import (PACKING_KEYS, REAL_TOKENS, gather_over, keeps_whole, packed_cu, refuse_other_batches,
                          shard_positions, shard_rows)
from ndp.hf.models import Unsupported
from ndp.parallel import (CP_ATTR, NDP_FIELDS, PARALLEL_ATTR, Parallelized, ParallelismConfig, adopt_mesh, apply_cp,
                          apply_tp,
                          check_mesh, is_transformers_model, match_modules)
from ndp.parallel.draws import DRAWS_ATTR
from ndp.parallel.mesh import mesh_axis
from ndp.parallel.parallelize import fresh_autocast_casts, tie_experts
from ndp.train.checkpoint import stateful_params
from ndp.train.config import ENV_PARALLEL

__all__ = ["Accelerator", "ndp_config", "accelerate_config", "fsdp2_state_on_cpu", "shard_buffers",
           "saved_optimizer_state", "batch_ranks", "DataParallelDispatcher", "redealt_on_skip"]

# accelerate launch passes its ParallelismConfig through PARALLELISM_CONFIG_* variables; ndp's own fields these
# (ndp-train's variables of the fields Accelerate has no name for).
ENV_FIELDS = {name: (var, kind) for var, (name, kind) in ENV_PARALLEL.items() if name in NDP_FIELDS}


def ndp_config(parallelism_config, **fields) -> ParallelismConfig:
    """ndp's ParallelismConfig of Accelerate's, with ndp's fields from `fields`, else the environment
    (``ENV_FIELDS``), else their defaults."""
    for name, (var, kind) in ENV_FIELDS.items():
        if fields.get(name) is None and os.environ.get(var):
            fields[name] = kind(os.environ[var])
    return ParallelismConfig.from_accelerate(parallelism_config,
                                             **{k: v for k, v in fields.items() if v is not None})


def accelerate_config(config: ParallelismConfig) -> accelerate.ParallelismConfig:
    """Accelerate's ParallelismConfig of ndp's (the degrees; ndp's own fields go to :class:`Accelerator`'s
    ``cp_impl``, ``ulysses_size``, ``cp_layout``, ``cp_mixers``): the way back from
    ``ParallelismConfig.from_accelerate``."""
    return accelerate.ParallelismConfig(dp_replicate_size=config.dp_replicate_size,
                                        dp_shard_size=config.dp_shard_size, cp_size=config.cp_size,
                                        tp_size=config.tp_size)


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` with ndp's context parallelism (see the module docstring for what it overrides).

    Args:
        cp_impl, ulysses_size, cp_layout, cp_mixers: ndp's CP algorithm, all-to-all degree, layout and what it does
            with token mixers outside attention (``ParallelismConfig``); None: ``NDP_*`` from the environment, else
            ring / 1 / zigzag / refuse.
        args, kwargs: ``accelerate.Accelerator``'s.
    """

    def __init__(self, *args, cp_impl=None, ulysses_size=None, cp_layout=None, cp_mixers=None, **kwargs):
        self._ndp_fields = dict(cp_impl=cp_impl, ulysses_size=ulysses_size, cp_layout=cp_layout, cp_mixers=cp_mixers)
        self._ndp_step = None
        self._ndp_alone = []  # models prepared without an optimizer (prepare)
        self._ndp_cp_only = []  # models given CP alone (prepare_cp)
        # True: each CP rank holds its data-parallel batch's whole values, not a shard's (gather_for_metrics)
        self.whole_batch_metrics = False
        pc = kwargs.get("parallelism_config")
        if pc is not None:
            ndp_config(pc, **self._ndp_fields)  # refuse a bad field by name before any process group work
        if kwargs.get("cpu") or not torch.cuda.is_available():
            kwargs["cpu"] = True
            if pc is not None and pc.total_size > 1 and kwargs.get("fsdp_plugin") is not None:
                fsdp2_state_on_cpu(kwargs)
        super().__init__(*args, **kwargs)

    @property
    def ndp_config(self) -> ParallelismConfig:
        """ndp's ParallelismConfig of this Accelerator's (its degrees and ndp's fields)."""
        return ndp_config(self.parallelism_config, **self._ndp_fields)

    def prepare(self, *args, device_placement=None):
        """Accelerate's; under FSDP2 a model without an optimizer too (an evaluation before any training: the
        Trainer's evaluate or predict first), which Accelerate refuses: it asks for the optimizer to move its
        parameters onto the sharded ones, and there is none. A placeholder over the model's parameters takes its
        place, dropped after. When its optimizer comes, with it or alone, the model is not prepared again."""
        modules = [a for a in args if isinstance(a, torch.nn.Module)]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        if self.is_fsdp2 and self._ndp_alone and optimizers and all(self._alone(m) for m in modules) and all(
                any(_optimizes(o, m) for m in self._ndp_alone) for o in optimizers):
            # the optimizer of the model prepared for evaluation first, built on its sharded parameters: nothing to
            # shard or move; the model back among the prepared ones (the Trainer frees them before training), as
            # saving and CP read them there
            self._models.extend(m for m in self._ndp_alone if not any(m is x for x in self._models))
            out = tuple(a if isinstance(a, torch.nn.Module) else
                        self._prepare_one(self._prepare_one(a, first_pass=True)) for a in args)
            return out[0] if len(out) == 1 else out
        if not (self.is_fsdp2 and len(modules) == 1 and not optimizers):
            return super().prepare(*args, device_placement=device_placement)
        placeholder = torch.optim.SGD(modules[0].parameters(), lr=0.0)
        out = super().prepare(*args, placeholder, device_placement=device_placement and [*device_placement, False])
        self._optimizers.pop()  # the placeholder's wrapper: no state, never stepped
        self._ndp_alone.extend(obj for obj in out if isinstance(obj, torch.nn.Module))
        return out[0] if len(args) == 1 else out[:-1]

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        # the Trainer's evaluation before any training under torch_compile: Accelerate's prepare_model would apply
        # neither CP nor FSDP2 (the CP evaluation step then refused): prepared as prepare does, the model alone (not
        # a model distributed already: DTensor parameters, as transformers' own loading gives them)
        if (evaluation_mode and self.is_fsdp2 and self.parallelism_config and not self._alone(model)
                and not any(isinstance(p, DTensor) for p in model.parameters())):
            return self.prepare(model, device_placement=None if device_placement is None else [device_placement])
        return super().prepare_model(model, device_placement, evaluation_mode)

    def _alone(self, module) -> bool:
        """`module` (or the module it compiles) is one :meth:`prepare` took without an optimizer."""
        return any(getattr(module, "_orig_mod", module) is getattr(m, "_orig_mod", m) for m in self._ndp_alone)

    def _prepare_tp(self, *args):
        """Accelerate's TP takes a model transformers loaded sharded over the TP ranks (DTensor parameters) and skips
        any other with a warning: tp_size dropped, each TP rank computing the whole model. Such a model gets ndp's
        TP instead (the model's own plan, checked as ``ndp.hf.parallelize`` checks it), the optimizers' references
        moved onto the split parameters; a model split by ndp's TP already passes; one loaded sharded is refused."""
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        split = [m for m in models if any(isinstance(p, DTensor) for p in m.parameters())]
        if any(not hasattr(m, DRAWS_ATTR) for m in split):
            raise ValueError(f"ndp.accelerate: tp_size={self.parallelism_config.tp_size} and a model split already, "
                             f"not by ndp (DTensor parameters: transformers loaded split, from_pretrained(..., "
                             f"tp_plan=..., device_mesh=...), or sharded before prepare): ndp splits the model itself, "
                             f"with its own plan checked exact and dropout drawn alike on the TP ranks. Load it whole, "
                             f"without tp_plan / device_mesh / distributed_config: "
                             f"AutoModelForCausalLM.from_pretrained(path).")
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        for model in models:
            if any(model is m for m in split):
                continue  # split by ndp's TP already (Accelerator.prepare_tp)
            if not is_transformers_model(model):
                raise ValueError(f"ndp.accelerate splits transformers models by tensor parallel (tp_size="
                                 f"{self.parallelism_config.tp_size}); got a {type(model).__name__}. Use "
                                 f"ndp.parallelize with a ModelPlan(tp_plan=...) for other modules.")
            plan = ndp.hf.hf_plan(model).tp_plan
            ndp.hf.check_model(model, self.ndp_config)
            ndp.hf.check_tp_plan(model, plan)
            names = {id(p): n for n, p in model.named_parameters()}
            apply_tp(model, mesh_axis(self.torch_device_mesh, "tp"), plan)
            params = dict(model.named_parameters())
            for opt in optimizers:
                for group in opt.param_groups:
                    group["params"] = [params[names[id(p)]] if id(p) in names else p for p in group["params"]]
        return args

    def _prepare_cp(self, *args):
        cfg, mesh = self.ndp_config, self.torch_device_mesh
        check_mesh(cfg, mesh)
        adopt_mesh(cfg, mesh)
        for model in args:
            if not isinstance(model, torch.nn.Module):
                continue
            if not hasattr(model, "set_attn_implementation"):
                raise ValueError(f"ndp.accelerate runs context parallelism for transformers models; got a "
                                 f"{type(model).__name__}. Use ndp.parallelize with a ModelPlan for other modules.")
            ndp.hf.check_model(model, cfg)
            apply_cp(model, cfg, mesh, ndp.hf.hf_plan(model))
            setattr(model, PARALLEL_ATTR, Parallelized(cfg, mesh))
            # first: the document table it adds is what ndp.hf's position check reads
            model.register_forward_pre_hook(self._ndp_forward_kwargs, with_kwargs=True, prepend=True)
        return args

    def prepare_tp(self, model):
        """ndp's TP on a transformers model prepared outside the Accelerator, before anything shards it (TRL's DPO /
        KTO reference model, which TRL shards with FSDP2 itself), as :meth:`_prepare_tp` splits it (a model ndp split
        already passes, one transformers loaded split is refused); any model without tp_size > 1 is returned as it
        is."""
        if self.parallelism_config and self.parallelism_config.tp_enabled:
            self._prepare_tp(model)
        return model

    def prepare_cp(self, model):
        """ndp's CP on a transformers model prepared outside the Accelerator (TRL shards a DPO reference model with
        FSDP2 itself), once: a model that has it, or any model without cp_size > 1, is returned as it is."""
        if self.parallelism_config and self.parallelism_config.cp_enabled and not hasattr(model, PARALLEL_ATTR):
            self._prepare_cp(model)
            self._ndp_cp_only.append(model)  # its CP context serves maybe_context_parallel before prepare
        return model

    def _prepare_fsdp2(self, *args):
        result = super()._prepare_fsdp2(*args)
        # Accelerate's fully_shard, as ndp's apply_fsdp: an expert that none of this rank's tokens reached (fewer
        # under CP, each rank holding a shard of the sequence) has no gradient here, and the ranks' reduce-scatters
        # disagree (gloo aborts, NCCL hangs); tied after fully_shard, so the tie runs on the gathered parameters.
        for obj in result:
            model = getattr(obj, "_orig_mod", obj)
            if not isinstance(model, torch.nn.Module):
                continue
            fresh_autocast_casts(model, self.device.type)  # as ndp's own FSDP2 (apply_fsdp)
            if is_transformers_model(model):
                for _, block in match_modules(model, ndp.hf.hf_plan(model).blocks):
                    tie_experts(block)
                # Accelerate gives the input embedding a unit of its own, resharded after its forward; Gemma 4 reads
                # its weight after that (a pad row, outside the embedding's forward): kept gathered to its backward,
                # as the root unit holds it in ndp's own FSDP2
                embed = model.get_input_embeddings()
                if isinstance(embed, FSDPModule):
                    embed.set_reshard_after_forward(False)
                _gather_head_with_forward(obj, model.get_output_embeddings())
        return result

    def _ndp_forward_kwargs(self, model, args, kwargs):
        """Inside maybe_context_parallel: the document table (the labels and num_items_in_batch of the model's loss:
        ``ndp.hf.batch.guard_labels``, which enable_cp registered)."""
        if self._ndp_step is None:
            return None
        if keeps_whole(model, kwargs):  # the same batch on every CP rank: each refuses here, before any layer
            raise Unsupported(
                f"{type(model).__name__} got a tower's input (pixel_values, ...) inside maybe_context_parallel, which "
                f"shards the buffers before the model: the tower would meet this rank's shard of the placeholders. "
                f"Give the batch to the model whole and let its text decoder take the shard: batch = "
                f"ndp.hf.shard_batch(model, **batch) (outside maybe_context_parallel), or ndp.trainer's trainers.")
        extra = dict(self._ndp_step)
        if "cu_seq_lens_q" not in extra and kwargs.get("cu_seq_lens_q") is not None:
            extra.update(_dense_table(kwargs["cu_seq_lens_q"]))
        return args, {**kwargs, **extra}

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Accelerate's; with ``even_batches=False``, refused on every rank where the ranks' batch counts differ: a
        rank out of batches would leave the others waiting in their next collective (FSDP2's all-gather, a CP
        exchange: a hang). Accelerate's default (even batches: the last one completed from the data's start) is left
        alone, and so is a loader without a length. A dispatching loader (``dispatch_batches``: Accelerate's default
        for an iterable dataset) deals its batches by data-parallel rank (:class:`DataParallelDispatcher`)."""
        prepared = super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        dispatches = isinstance(prepared, DataLoaderDispatcher) and not isinstance(prepared, DataParallelDispatcher)
        if dispatches and getattr(self, "torch_device_mesh", None) is not None:  # (a loader prepared again: as it is)
            dealer = DataParallelDispatcher.of(prepared, self.torch_device_mesh)
            self._dataloaders[self._dataloaders.index(prepared)] = prepared = dealer
        if not self.even_batches and dist.is_initialized() and dist.get_world_size() > 1:
            _refuse_uneven_batches(prepared, self.device)
        return prepared

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """Accelerate's; a loader dealing by data-parallel rank (:class:`DataParallelDispatcher`) still does, where
        Accelerate's rebuilds it as its own, one piece per process."""
        skipped = super().skip_first_batches(dataloader, num_batches)
        if isinstance(dataloader, DataParallelDispatcher):
            return DataParallelDispatcher.of(skipped, self.torch_device_mesh)
        return skipped

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """Accelerate's, each data-parallel batch's entries once: gathered from its CP ranks (each holds a part or a
        copy of a value, e.g. TRL's token sums, a shard's per-token values) but not its TP ranks (each holds a copy),
        and the padded last step cut by data-parallel sample, each kept sample's CP entries together (Accelerate
        gathers every rank and cuts entry by entry: under CP a per-sample tensor kept the first samples' entries of
        the first CP ranks only)."""
        mesh = self.torch_device_mesh if self.parallelism_config else None
        if mesh is None or use_gather_object or batch_ranks(mesh) == 1 or not _all_tensors(input_data):
            return super().gather_for_metrics(input_data, use_gather_object)
        state = self.gradient_state
        cp = 1 if self.whole_batch_metrics else mesh_axis(mesh, "cp").size()
        cut = state.end_of_dataloader and state.remainder > 0

        def gather(t):
            t = t.reshape(1) if t.dim() == 0 else t  # a per-rank value: one entry
            parts = gather_over(t, mesh_axis(mesh, "dp" if cp == 1 else "dp_cp"))  # [dp, cp, rows] in mesh order
            return parts[_real_samples(len(parts) // (cp * len(t)), cp, len(t), state.remainder)] if cut else parts

        return recursively_apply(gather, input_data, error_on_other_type=True)

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None, *,
                               position_ids=None, names=None):
        """Accelerate's, on ndp's CP (module docstring). position_ids: which buffer holds the positions; without it
        a packed batch is recognised by a buffer whose values restart at 0. names: the buffers' names as the model
        takes them (``input_ids``, ``labels``, ``shift_labels``, ``position_ids``, ``attention_mask``, ``seq_idx``;
        ndp's Trainer passes them): the batch is then padded by name where the CP layout needs it
        (``shard_buffers``)."""
        buffers = list(buffers or [])
        rows = dict(zip(names, buffers)) if names is not None else {f"buffer{i}": b for i, b in enumerate(buffers)}
        if self.parallelism_config:  # the CP and TP ranks of a batch (TP alone too: each would split another batch)
            refuse_other_batches(rows, self.torch_device_mesh, "maybe_context_parallel",
                                 "; prepared by the Accelerator (accelerator.prepare(loader)) a data loader does so")
        if not (self.parallelism_config and self.parallelism_config.cp_enabled):
            with super().maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers):
                yield
            return
        keep = no_restore_buffers or set()
        shards, extra = shard_buffers(buffers, buffer_seq_dims, self._cp_context_of_models(), position_ids, names)
        saved = [None if any(b is t for t in keep) else b.clone() for b in buffers]
        for b, s in zip(buffers, shards):
            b.resize_(s.shape).copy_(s)
        # the shard's facts of the batch (its tokens, its longest position), which the buffers the model gets lack
        positions = next((s for s in shards if hasattr(s, REAL_TOKENS)), None)
        self._ndp_step = extra
        try:
            with shard_positions(positions):
                yield
        finally:
            self._ndp_step = None
            for b, old in zip(buffers, saved):
                if old is not None:
                    b.resize_(old.shape).copy_(old)

    def _cp_context_of_models(self):
        ctxs = [getattr(m, CP_ATTR) for m in (*self._models, *self._ndp_cp_only) if hasattr(m, CP_ATTR)]
        if not ctxs:
            raise ValueError("maybe_context_parallel with cp_size > 1 needs the model prepared first: "
                             "model = accelerator.prepare(model)")
        return ctxs[0]


class DataParallelState:
    """The process state a dispatching loader deals batches by, counted in data-parallel ranks: as many pieces as
    data-parallel ranks, this process's its data-parallel rank's (its CP and TP ranks take the same piece); anything
    else is the process's own state."""

    def __init__(self, state, dp):
        self.process_state, self.num_processes, self.process_index = state, dp.size(), dp.get_local_rank()

    def __getattr__(self, name):
        return getattr(self.process_state, name)


class DataParallelDispatcher(DataLoaderDispatcher):
    """Accelerate's dispatching loader (process 0 reads, every process gets its piece) dealing by data-parallel rank.
    Accelerate's deals one piece per process: under CP the ranks of one batch got different rows (refused by
    ``maybe_context_parallel``), and with TP, whose ranks it gives process 0's piece, beside data parallelism every
    data-parallel rank trained on the same batch, silently (dp_shard 2 x tp 2: one batch twice a step). Process 0 still
    reads alone, one batch per data-parallel rank; batches it cannot deal (rows of different lengths) are refused on
    every process, where Accelerate raised on process 0 and left the others waiting."""

    @classmethod
    def of(cls, loader, mesh):
        """`loader` (Accelerate's, as prepared) dealing by the data-parallel ranks of `mesh`."""
        dealer = object.__new__(cls)  # Accelerate's loaders report their base loader's class: no __class__ swap
        dealer.__dict__.update(loader.__dict__)
        dealer.state = DataParallelState(loader.state, mesh_axis(mesh, "dp"))
        return dealer

    def _fetch_batches(self, iterator):
        reads = self.state.process_state.process_index == 0
        batches, batch, info = [], None, [None, self._stop_iteration, None]
        if reads:
            try:
                for _ in range(1 if self.split_batches else self.state.num_processes):
                    self._update_state_dict()
                    batches.append(next(iterator))
                batch, info = _dealt(batches)
            except StopIteration:
                info = [None, True, None]
        info = _shared(info)
        self._stop_iteration = info[1]
        if self._stop_iteration and not self.split_batches and not self._drop_last:  # fewer batches than ranks left
            batch, info = _dealt(batches) if reads and batches else (None, [None, True, None])
            info = _shared(info)
        if info[0] is None:
            return None, info[:2]
        return (batch if reads else initialize_tensors(info[0])), info[:2]

    def __reduce__(self):
        raise TypeError("ndp's dispatching data loader holds its process's place in the device mesh and is not "
                        "pickled; prepare the loader again in the process that iterates it.")


def redealt_on_skip(loader) -> bool:
    """Whether Accelerate's ``skip_first_batches`` (the Trainer's mid-epoch resume) would deal `loader`'s batches
    wrongly: it rebuilds a dispatching loader as its own, one piece per process, where `loader` deals fewer pieces
    (each data-parallel rank's to its CP and TP ranks)."""
    return isinstance(loader, DataParallelDispatcher) and loader.state.num_processes < dist.get_world_size()


def _dealt(batches) -> tuple:
    """(the batches concatenated, [its structure, no stop, None]); where they cannot be, or cannot be dealt by
    slicing their first dim, (None, [None, no stop, why])."""
    firsts = set()
    # a packed batch's document table is no row (ndp rebuilds the shards' from the positions)
    first = batches[0]
    dealt = {k: v for k, v in first.items() if k not in PACKING_KEYS} if isinstance(first, Mapping) else first
    recursively_apply(lambda t: firsts.add(t.shape[0] if t.dim() else None), dealt)
    if len(firsts) > 1:  # the batch's rows and another count (a VLM's flattened image patches: Qwen-VL's pixel_values)
        return None, [None, False, f"a batch process 0 read to deal to the data-parallel ranks holds tensors of "
                                   f"different first dims ({sorted(firsts, key=str)}): dealing slices every tensor "
                                   f"along its first dim, so a rank would get other rows' pieces of the ones that do "
                                   f"not count rows (a vision-language model's flattened image patches). Set "
                                   f"dispatch_batches=False (Accelerate's accelerator_config; each process then reads "
                                   f"its own batches)."]
    try:
        batch = concatenate(batches, dim=0)
    except RuntimeError as e:
        return None, [None, False, f"the batches process 0 read to deal to the data-parallel ranks cannot be "
                                   f"concatenated ({e}): rows of different lengths. Pad every batch to one length (a "
                                   f"collator's padding='max_length'), or set dispatch_batches=False (Accelerate's "
                                   f"accelerator_config; each process then reads its own batches)."]
    return batch, [get_data_structure(batch), False, None]


def _shared(info) -> list:
    """Process 0's `info`, on every process; its reason, where it has one, raised on every process."""
    broadcast_object_list(info)
    if info[2] is not None:
        raise ValueError(info[2])
    return info


def _refuse_uneven_batches(loader, device) -> None:
    """Raise on every rank when the ranks' prepared loaders hold different numbers of batches (one all-reduce)."""
    try:
        count = len(loader)
    except TypeError:  # an iterable dataset: its length is unknown
        return
    bounds = torch.tensor([count, -count], device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    most, fewest = int(bounds[0]), -int(bounds[1])
    if most != fewest:
        raise ValueError(f"even_batches=False gives the ranks {fewest} to {most} batches each (this rank {count}): "
                         f"a rank out of batches would leave the others waiting in their next collective (FSDP2's "
                         f"all-gather, a context-parallel exchange), a hang. Keep even_batches=True (Accelerate's "
                         f"default: the last batch completed from the start of the data), or use drop_last=True or "
                         f"a dataset the ranks' batches divide.")


def _all_tensors(data) -> bool:
    """Whether `data` is tensors (nested in lists, tuples, dicts) only: Accelerate gathers anything else as objects."""
    try:
        recursively_apply(lambda t: t, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def _optimizes(optimizer, model) -> bool:
    """Whether every parameter `optimizer` holds is one of `model`'s."""
    own = {id(p) for p in model.parameters()}
    return all(id(p) in own for g in optimizer.param_groups for p in g["params"])


def _real_samples(dp, cp, rows, remainder) -> torch.Tensor:
    """Which of the last step's entries gathered over dp x cp ranks (`rows` per rank, in mesh order) are of real
    samples: Accelerate pads the last global batch after its `remainder` real samples, data-parallel rank by rank."""
    sample = torch.arange(dp)[:, None, None] * rows + torch.arange(rows)[None, None, :]
    return (sample < remainder).expand(dp, cp, rows).reshape(-1)


def batch_ranks(mesh) -> int:
    """How many ranks hold each data-parallel batch whole (its CP and TP ranks): the world over the data-parallel
    ranks."""
    return mesh.size() // mesh_axis(mesh, "dp").size()


def _gather_head_with_forward(wrapper, head) -> None:
    """Accelerate shards the output embedding in one unit with the final norm it finds among the base model's
    children, so the norm's forward gathers both. Where it finds none (OPT's decoder.final_layer_norm, a
    multimodal model's language model) the head is a unit of its own, gathered only when called as a module; TRL's
    fused LM head reads its weight directly, a DTensor whose gradient then misses FSDP2's reduce-scatter (OPT's
    head moved 0.92x one process's at dp_shard 2). Such a head is gathered as the model's forward starts; FSDP2
    reduce-scatters its gradient at the end of the backward, as for any unit whose forward hooks did not run."""
    if isinstance(head, FSDPModule) and len(head._get_fsdp_state()._modules) == 1:
        wrapper.register_forward_pre_hook(lambda module, args: head.unshard())


def fsdp2_state_on_cpu(kwargs) -> None:
    """Accelerate runs ND-parallel only as FSDP2 and sets that up for accelerators alone; on CPU the same FSDP2 runs
    over gloo, so the shared state is made FSDP2 before Accelerate's own checks read it."""
    dynamo = kwargs.get("dynamo_plugin") or TorchDynamoPlugin(
        **({"backend": kwargs["dynamo_backend"]} if kwargs.get("dynamo_backend") else {}))
    state = AcceleratorState(cpu=True, mixed_precision=kwargs.get("mixed_precision"), dynamo_plugin=dynamo,
                             fsdp_plugin=kwargs["fsdp_plugin"], parallelism_config=kwargs["parallelism_config"],
                             _from_accelerator=True)
    if state.distributed_type == DistributedType.MULTI_CPU:
        # Accelerate copies the process state into its own on every construction: both say FSDP.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = kwargs["fsdp_plugin"]


def saved_optimizer_state(checkpoint):
    """(the parameters holding optimizer state, the param groups of a full state dict or None) of the optimizer
    Accelerate saved for FSDP2 in ``checkpoint``, read by rank 0 and the same on every rank; None where no such
    save is found (collective: a file rank 0 cannot read raises on every rank, none waits)."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = _read_optimizer_state(checkpoint)
        except Exception as e:  # noqa: BLE001 -- sent to every rank, raised there
            box[0] = RuntimeError(f"ndp: rank 0 could not read the optimizer state in {checkpoint}: "
                                  f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def _read_optimizer_state(checkpoint):
    sharded = os.path.join(checkpoint, f"{OPTIMIZER_NAME}_0")  # DCP (SHARDED_STATE_DICT)
    if os.path.isdir(sharded):
        return stateful_params(dcp.FileSystemReader(sharded).read_metadata().state_dict_metadata,
                               "optimizer.state."), None
    for name in (f"{OPTIMIZER_NAME}.bin", f"{OPTIMIZER_NAME}_0_rank0.bin"):  # FULL_STATE_DICT; per rank, no DCP
        path = os.path.join(checkpoint, name)
        if os.path.isfile(path):
            osd = torch.load(path, mmap=True, weights_only=True)
            return set(osd["state"]), osd["param_groups"] if name == f"{OPTIMIZER_NAME}.bin" else None
    return None


def _dense_table(cu):
    """The model kwargs replacing a document table the caller passed for buffers sharded as dense rows: one document
    is the rows themselves (the table dropped); more are documents the buffers did not show (ValueError)."""
    if cu.numel() > 2:
        raise ValueError(f"the model got a packed batch's document table (cu_seq_lens_q, {cu.numel() - 1} documents) "
                         f"but maybe_context_parallel sharded its buffers as dense rows (no buffer of position_ids "
                         f"restarting at each document): the shards would not be the table's. Pass the batch's "
                         f"position_ids among the buffers (DataCollatorWithFlattening makes them).")
    return dict.fromkeys(PACKING_KEYS)


def shard_buffers(buffers, seq_dims, ctx, position_ids=None, names=None):
    """Each buffer's CP shard (dim 1 of ``[batch, seq]`` tensors) and the extra model kwargs: dense rows in
    ``ctx.layout``; packed rows (a buffer of positions restarting at 0 inside a row) per document, with the
    document table the attention needs (`position_ids`: the buffer of positions, else recognised by its values).
    With `names` (the buffers' model argument names) the batch is sharded as ``ndp.hf.shard_batch`` shards it:
    dense rows padded at the end to the layout's multiple, a packed batch too short for every rank given a padding
    document, both with labels -100 at the pads, so the loss and gradients are the batch's. Everything is checked
    before anything is sharded.

    Raises:
        ValueError: a buffer that is not ``[batch, seq]`` with its sequence on dim 1, buffers of different
            sequence lengths, packed rows whose buffers differ in shape, names that do not name each buffer once;
            without names, dense rows whose length the layout cannot shard or a packed batch too short for every
            rank (which buffer holds the labels is unknown, so neither is padded).
    """
    dims = list(seq_dims) if seq_dims is not None else [1] * len(buffers)
    if len(dims) != len(buffers):
        raise ValueError(f"maybe_context_parallel got {len(buffers)} buffers and {len(dims)} buffer_seq_dims")
    bad = [i for i, (b, d) in enumerate(zip(buffers, dims)) if not torch.is_tensor(b) or b.dim() != 2 or d != 1]
    if bad:
        raise ValueError(f"ndp.accelerate shards [batch, seq] buffers along dim 1; buffers {bad} are not (shapes "
                         f"{[tuple(buffers[i].shape) if torch.is_tensor(buffers[i]) else None for i in bad]}, "
                         f"seq dims {[dims[i] for i in bad]})")
    lengths = {b.shape[1] for b in buffers}
    if len(lengths) > 1:
        raise ValueError(f"maybe_context_parallel's buffers have sequence lengths {sorted(lengths)}; they must be one")
    if names is not None:
        return _shard_named(buffers, names, ctx)
    rows = {f"buffer{i}": b for i, b in enumerate(buffers)}
    cu, name = _packed(rows, position_ids)
    if cu is None:
        _check_dense_length(next(iter(lengths)), ctx)
        return [shard_rows({k: t}, ctx, pad=False)[k] for k, t in rows.items()], {}
    if len({tuple(b.shape) for b in buffers}) > 1:
        raise ValueError(f"packed rows (buffer {name} restarts its positions) need every buffer in one shape; got "
                         f"{[tuple(b.shape) for b in buffers]}")
    # pad=False: the buffers are unnamed (which one holds the labels is unknown), so a packed batch too short for
    # every rank is refused, not padded
    out = shard_rows({("position_ids" if k == name else k): t for k, t in rows.items()}, ctx, cu=cu, pad=False)
    shards = [out["position_ids" if k == name else k] for k in rows]
    return shards, {k: v for k, v in out.items() if k in PACKING_KEYS}


def _shard_named(buffers, names, ctx):
    names = list(names)
    if len(names) != len(buffers) or len(set(names)) != len(names):
        raise ValueError(f"maybe_context_parallel(names=...) names each buffer once; got {len(names)} names "
                         f"{names} for {len(buffers)} buffers")
    rows = dict(zip(names, buffers))
    out = shard_rows(rows, ctx, cu=packed_cu(rows), pad=True)
    return [out[k] for k in names], {k: v for k, v in out.items() if k in PACKING_KEYS}


def _check_dense_length(seq, ctx):
    need = seq_multiple(ctx.size, ctx.layout)
    if seq % need:
        raise ValueError(f"maybe_context_parallel: dense rows of {seq} tokens do not split into the {ctx.layout} "
                         f"layout's pieces over cp_size={ctx.size} (a multiple of {need} is needed), and unnamed "
                         f"buffers are not padded (which one holds the labels is unknown). Pad the batch to a "
                         f"multiple of {need} with labels -100 at the pads (e.g. DataCollatorForLanguageModeling("
                         f"pad_to_multiple_of={need})), or pass names=[...] (the buffers' model argument names, as "
                         f"ndp.trainer does) and ndp pads it.")


def _packed(rows, position_ids=None):
    """(global cu_seqlens, buffer name) when the positions restart at 0 inside a row (``DataCollatorWithFlattening``),
    else (None, None). `position_ids`: the buffer that holds them; else the buffer whose every row starts at 0 and
    only steps by +1 or back to 0 (never two zeros in a row, which would be a one-token document or a seq_idx: such
    a batch is sharded dense, and ndp's attention refuses its positions by name rather than guess)."""
    if position_ids is not None:
        name = next((k for k, t in rows.items() if t is position_ids), None)
        if name is None:
            raise ValueError("maybe_context_parallel(position_ids=...) must be one of the buffers (it is sharded "
                             "with them)")
        cu = packed_rows_cu(position_ids, *position_ids.shape)
        return (cu, name) if cu is not None else (None, None)
    found = {}
    for name, t in rows.items():
        if t.is_floating_point() or t.numel() == 0 or bool((t[:, 0] != 0).any()):
            continue
        step = t[:, 1:] - t[:, :-1]
        restart = t[:, 1:] == 0
        double_zero = restart & (t[:, :-1] == 0)
        if bool(((step == 1) | restart).all()) and bool(restart.any()) and not bool(double_zero.any()):
            found[name] = position_restarts(t)
    if not found:
        return None, None
    first = next(iter(found.values()))
    if any(not torch.equal(s, first) for s in found.values()):
        raise ValueError(f"buffers {sorted(found)} all look like packed position_ids but restart at different "
                         f"tokens; pass one position_ids buffer")
    name = next(iter(found))
    return cu_from_starts(first), name
