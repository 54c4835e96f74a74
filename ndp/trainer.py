"""``transformers.Trainer`` on ndp's context parallelism.

``TrainingArguments(parallelism_config=ParallelismConfig(cp_size=...))`` makes the Trainer run torch's context
parallelism, for SDPA attention only. :class:`Trainer` runs ndp's instead, for every attention ndp serves (sliding
windows, sinks, GQA, packed documents): use it in place of ``transformers.Trainer``, nothing else changes. It
subclasses ``transformers.Trainer`` (through :class:`NdpTrainerMixin`, which other Trainer subclasses can take)
and overrides, patching nothing for good (two library functions that the libraries call by name are replaced
while one call of ndp's runs, then put back: :func:`_replaced`):

- ``_build_accelerator_args`` / ``create_accelerator_and_postprocess``: with a ``parallelism_config``, the Trainer's
  Accelerator becomes ``ndp.accelerate.Accelerator`` built from the same arguments (on CPU, FSDP2 over gloo; with
  or without CP: its FSDP2 keeps MoE layers' reduce-scatters the same on every rank);
- ``_build_accelerator_args`` also refuses, under CP, a TRL trainer whose loss is not a sum over tokens
  (GKD, and DPO, KTO or reward modelling on the mixin alone: per-sequence sums or pooled scores, each rank
  holding a shard of every sequence); transformers.Trainer's loss and trl.SFTTrainer's are exact, DPO and KTO are
  on :class:`DPOTrainer` and :class:`KTOTrainer` (:class:`NdpSequenceLossMixin`: each model call sharded, its
  per-token log-probabilities gathered back), reward modelling on :class:`RewardTrainer`
  (:class:`NdpPooledScoreMixin`: its per-token scores gathered back and pooled as transformers pools them);
- ``prediction_step``: under CP the loss-only evaluation step runs on each rank's shard (for ``trl.SFTTrainer`` too,
  whose own step does not shard), each rank's loss becomes its data-parallel batch's (combined over the CP group as
  the trainer normalises: transformers' by the tokens counted before sharding, TRL's by each batch's own), and
  evaluation gathers one entry per data-parallel rank (``gather_function``, under TP too), so the eval loss is
  the one a run without CP on the same data-parallel ranks reports (Trainer's evaluation would otherwise gather
  the CP ranks' partial losses as samples and report a wrong loss; under TP each batch's loss once per TP rank,
  and the last partial step cut to its first entries: dp_shard 2 x tp 2 on 5 rows weighed 4 rows twice), set by
  ``evaluation_loop`` for each loop (transformers resets it after every loop); with ``compute_metrics`` or
  ``Trainer.predict`` under CP each rank's shard of the per-token outputs (logits, hidden states) is gathered back
  into the batch's order on every CP rank (``ndp.hf.batch.gather_tokens``) and the labels are the batch's, so the
  predictions are a run without CP's; outputs not per token are refused by name;
- ``_prepare_context_parallel_inputs``: without CP, a batch that differs between the TP ranks (a sampler of one's own
  over every rank) is refused on every rank (``ndp.hf.batch.refuse_other_batches``; under CP
  ``maybe_context_parallel`` compares the CP and TP ranks); under CP every per-token tensor of the batch (input_ids,
  labels, shift_labels made before sharding, position_ids, the attention mask, made all ones for a right-padded batch
  whose every pad is labelled -100: ``ndp.hf.batch.without_padding``, and any other of input_ids' shape, such as
  token_type_ids) goes to ndp's ``maybe_context_parallel`` by name, without the SDPA-only check: any length trains
  (rows the CP layout cannot split are padded at the end, labels -100, as ``ndp.hf.shard_batch`` pads), and a packed
  batch's document table is rebuilt for the shards from its positions (made per document from the collator's table
  where it gave none); NEFTune's noise keeps the batch's magnitude (it reads the row length from the shard). The
  Trainer's own ``num_items_in_batch`` (counted before sharding over every data-parallel rank and micro-batch)
  normalises the loss;
- ``compute_loss``: under CP, an MoE's load-balancing loss in the model's loss is each rank's share of its
  batch's (``ndp.hf.router.losses_summed``: the Trainer sums the ranks' losses); label smoothing
  (``label_smoothing_factor``) on a causal LM shifts its labels as the Trainer means (whose test by class name
  fails under FSDP2, which renames the class: it did not shift at all), under CP the labels shifted before sharding
  (the smoother would shift each shard's); a ``compute_loss_func`` under CP is refused (it would get each rank's
  shard of the logits and labels);
- classification heads (:class:`Trainer`, with or without CP): a token classifier's loss is computed from its
  logits with the Trainer's token count, its labels sharded unshifted under CP, and a sequence classifier's call
  means are averaged by the Trainer (transformers' heads drop the count the Trainer hands them, which then neither
  divides their loss by the accumulation steps nor keeps it from the processes' multiple:
  :func:`_count_classifier_loss`); under CP a sequence classifier runs as a reward model does, and so does
  question answering (:class:`NdpPooledScoreMixin`: the batch whole, each call sharded, the head's output read on
  the gathered row);
- ``_track_num_input_tokens``: ``num_input_tokens_seen`` counts each data-parallel batch once, before sharding
  (the Trainer counts after the step, when the batch's tensors hold this rank's shard, and gathers every rank's
  count: each CP shard, ndp's pads included, or a padded batch's pads, its mask made all ones);
- ``_run_epoch``: a resume in the middle of an epoch whose loader dispatches batches by data-parallel rank under CP
  or TP (``ndp.accelerate.DataParallelDispatcher``) skips the trained batches with the Accelerator's
  ``skip_first_batches``, which keeps the dealing (Accelerate's, which transformers calls by name, rebuilds the
  loader as its own, one piece per process: replaced in ``transformers.trainer`` for the resumed epoch);
- ``_load_optimizer_and_scheduler`` (FSDP2, with or without CP): a resume whose optimizer held no state for some
  parameters at save (never given a gradient; every parameter under plain SGD) loads, those left stateless as in
  the uninterrupted run (Accelerate's load stops on them).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from accelerate.utils import recursively_apply
from transformers.loss.loss_utils import ForTokenClassification
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer import SCHEDULER_NAME

from .accelerate import (Accelerator, batch_ranks, fsdp2_state_on_cpu, gather_over, redealt_on_skip,
                         saved_optimizer_state)
from .cp import sum_over_group
from .hf.batch import (ORIGIN, PACKING_KEYS, document_positions, gather_tokens, keeps_whole, origin_rows,
                       pad_id_of, refuse_other_batches, refuse_packed_whole, row_tensors, whole_batch, whole_rows,
                       without_padding)
from .hf.models import POOLED_ON_WHOLE, classifies_tokens, peft_inner, pooled_last_token, row_head
from .hf.router import losses_summed, recorded_shares
from .parallel import CP_ATTR, mesh_axis
from .parallel.init import clean_name

try:
    import trl
except ImportError:  # optional (ndp[hf]): Trainer works without it, SFTTrainer says what to install
    trl = None

__all__ = ["NdpTrainerMixin", "NdpSequenceLossMixin", "NdpPooledScoreMixin", "Trainer", "SFTTrainer", "DPOTrainer",
           "KTOTrainer", "RewardTrainer"]


class NdpTrainerMixin:
    """The overrides that put a ``transformers.Trainer`` (or a subclass of it) on ndp's context parallelism."""

    # Under CP the Trainer's batch is sharded before the loss; False: the loss reads the whole batch and each model
    # call inside shards its own (NdpSequenceLossMixin)
    _ndp_shards_batch = True
    # True: the model's head pools each row's scores from the gathered sequence (NdpPooledScoreMixin): no pad's
    # output is read
    _ndp_pools = False

    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        pc = args.get("parallelism_config")
        if pc is not None and pc.cp_enabled:
            _check_token_loss_trainer(type(self), pc.cp_size)  # before the Accelerator is built
        if pc is not None and not torch.cuda.is_available():
            args["cpu"] = True
            if args.get("fsdp_plugin") is not None:
                fsdp2_state_on_cpu(args)
        self._ndp_accelerator_args = args
        return args

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        args = self._ndp_accelerator_args
        if args.get("parallelism_config") is None:
            return
        # the Trainer built accelerate's Accelerator; ndp's, from the same arguments, takes its place (without CP
        # too: its FSDP2 ties MoE experts)
        self.accelerator = Accelerator(**args)

    def evaluation_loop(self, *args, **kwargs):
        if self._ranks_per_batch() > 1:
            # evaluation gathers one entry per data-parallel rank (its CP and TP ranks hold one batch: gathered from
            # every rank, each batch counted once per rank and the last, partial step cut to its first entries); set
            # for every loop, as transformers resets it to the Accelerator's after each (a second evaluation under
            # CP, or a predict after one, gathered each batch once per CP rank: the loss misweighted)
            self.gather_function = self._gather_over_dp
        return super().evaluation_loop(*args, **kwargs)

    def _inner(self, model):
        """The transformers model inside the Trainer's `model`: unwrapped from Accelerate's wrappers and from
        torch.compile's (whose class, OptimizedModule, names no head: under torch_compile=True the label smoother's
        causal-LM test failed, and a causal LM trained on unshifted labels), and from a PEFT wrapper."""
        return peft_inner(self.accelerator.unwrap_model(model, keep_torch_compile=False))

    def _cp_config(self):
        """The Accelerator's parallelism_config where it turns CP on, else None."""
        pc = getattr(self.accelerator, "parallelism_config", None)
        return pc if pc is not None and pc.cp_enabled else None

    def _prepare_context_parallel_inputs(self, model, inputs):
        pc = self._cp_config()
        if pc is None:
            # the TP ranks of a batch hold the same rows (under CP, maybe_context_parallel compares them)
            if getattr(self.accelerator, "parallelism_config", None) is not None:
                refuse_other_batches(inputs, self.accelerator.torch_device_mesh, "ndp.trainer",
                                     "; a sampler of one's own (_get_train_sampler) over the data-parallel ranks")
            return super()._prepare_context_parallel_inputs(model, inputs)
        if not self._ndp_shards_batch:
            return contextlib.nullcontext, inputs  # each model call shards its own (NdpSequenceLossMixin)
        return self._shard_for_cp(model, inputs, pc)

    @contextlib.contextmanager
    def _calls_on_shards(self, *models):
        """Inside, under CP, each call of `models` runs on this rank's shard of its tensors (:meth:`_shard_call`),
        its per-token outputs gathered back (:meth:`_gather_call`); where the trainer's batch is not sharded
        (:class:`NdpSequenceLossMixin`, :class:`NdpPooledScoreMixin`). Nested, the outer one serves."""
        pc = self._cp_config()
        if pc is None or not models or getattr(self, "_ndp_on_shards", False):
            yield
            return
        self._ndp_on_shards = True
        calls, handles = [], []
        for model in {id(m): m for m in models if m is not None}.values():
            self.accelerator.prepare_cp(model)
            handles += [model.register_forward_pre_hook(functools.partial(self._shard_call, pc, calls),
                                                        with_kwargs=True, prepend=True),
                        model.register_forward_hook(functools.partial(self._gather_call, pc, calls),
                                                    with_kwargs=True, always_call=True)]
        try:
            yield
        finally:
            self._ndp_on_shards = False
            for handle in handles:
                handle.remove()
            while calls:
                calls.pop()[0].close()

    def _sharded_models(self, model) -> tuple:
        """The models whose calls :meth:`compute_loss` runs on shards where the batch is not sharded."""
        return (model,) if self._ndp_pools else ()

    def _on_shard(self, pc, calls, model, kwargs, **rows):
        """The call's keyword arguments with its [batch, seq] tensors and `rows` (labels shifted before sharding)
        replaced by this rank's shards, the CP context entered; `calls` holds what :meth:`_gather_call` needs (the
        stack to leave, the shards' origin, the whole input_ids)."""
        like = kwargs["input_ids"]
        batch = {k: kwargs.pop(k).clone() for k in [k for k, v in kwargs.items()
                                                     if torch.is_tensor(v) and v.shape == like.shape]}
        batch.update(rows)
        batch[ORIGIN] = origin_rows(like)
        # a tower's inputs (pixel_values, ...) ride along: with them the call's rows reach the model whole
        towers = {k: v for k, v in kwargs.items() if torch.is_tensor(v)}
        cp_context, batch = self._shard_for_cp(model, {**batch, **towers}, pc)
        stack = contextlib.ExitStack()
        calls.append((stack, self._ndp_origin, like))
        stack.enter_context(cp_context())
        return {**kwargs, **batch}

    def _shard_for_cp(self, model, inputs, pc):
        """(the CP context to run the model in, the batch's tensors that context shards in place), as
        ``_prepare_context_parallel_inputs`` returns them (module docstring)."""
        inputs = dict(inputs)
        _check_token_batch(inputs, pc.cp_size)
        # what the token counts read (the Trainer's num_input_tokens_seen, TRL's num_tokens): the buffers are sharded
        # in place
        counted = (getattr(model, "main_input_name", "input_ids"), "attention_mask", "position_ids")
        self._ndp_unsharded = {k: inputs[k].clone() for k in counted if torch.is_tensor(inputs.get(k))}
        if "labels" in inputs and "shift_labels" not in inputs and not classifies_tokens(self._inner(model)):
            inputs["shift_labels"] = F.pad(inputs["labels"][:, 1:], (0, 1), value=-100)  # before sharding
        # a padded collator's batch: exact when every pad's label is -100, or when no pad's output is read
        inputs = without_padding(inputs, pads_read=not self._ndp_pools)
        # every per-token tensor (input_ids' shape: labels, position_ids, attention_mask, seq_idx, token_type_ids, ..)
        like = inputs.get("input_ids", inputs.get("labels"))
        names = [k for k, v in inputs.items() if torch.is_tensor(v) and v.dim() == 2 and v.shape == like.shape]
        if keeps_whole(self.accelerator.unwrap_model(model), inputs):
            return self._whole_for_cp(model, inputs)
        if "position_ids" not in inputs:
            inputs["position_ids"] = document_positions({k: inputs[k] for k in (*names, *PACKING_KEYS) if k in inputs})
            names.append("position_ids")
        # the collator's document table describes the unsharded rows: the shards' comes from the positions
        inputs = {k: v for k, v in inputs.items() if k not in PACKING_KEYS}
        buffers = [inputs[k] for k in names]
        self._ndp_origin = inputs.pop(ORIGIN, None)  # sharded with the batch, not the model's
        # named: a length the CP layout cannot split is padded (labels -100), as shard_batch pads
        cp_context = functools.partial(self.accelerator.maybe_context_parallel, buffers=buffers,
                                       buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers),
                                       names=names)
        return functools.partial(_neftune_of_batch, cp_context, self, model, like.shape[1], buffers[0]), inputs

    def _whole_for_cp(self, model, inputs):
        """:meth:`_shard_for_cp` of a batch with images (a tower's input): it reaches the model whole, its rows
        (``row_tensors``) padded to the CP layout's multiple and only the labels (and the origin) sharded, as
        ``ndp.hf.shard_batch`` gives it; the text decoder takes the shard (``ndp.hf.multimodal``)."""
        unwrapped = self.accelerator.unwrap_model(model)
        rows = row_tensors(inputs)
        refuse_other_batches({k: v for k, v in inputs.items() if torch.is_tensor(v)},
                             self.accelerator.torch_device_mesh, "ndp.trainer",
                             "; a sampler of one's own (_get_train_sampler) over the data-parallel ranks")
        refuse_packed_whole(unwrapped, inputs, rows)
        seq = inputs["input_ids"].shape[1]
        rows = whole_rows(rows, getattr(unwrapped, CP_ATTR), pad_id_of(unwrapped))
        inputs = {k: v for k, v in {**inputs, **rows}.items() if k not in PACKING_KEYS}
        self._ndp_origin = inputs.pop(ORIGIN, None)
        # the facts ride in the context: the Trainer's _prepare_inputs copies the tensors, dropping their attributes
        held = functools.partial(whole_batch, rows["input_ids"])
        return functools.partial(_neftune_of_batch, held, self, model, seq, rows["input_ids"]), inputs

    def compute_loss(self, model, inputs, *args, **kwargs):
        pc = self._cp_config()
        if pc is None or not self._ndp_shards_batch:
            with _smoothing_shifted(self, model, None), self._calls_on_shards(*self._sharded_models(model)):
                return super().compute_loss(model, inputs, *args, **kwargs)
        if self.compute_loss_func not in (None, getattr(self, "_ndp_token_loss", None)):
            raise ValueError(f"ndp.trainer: compute_loss_func under context parallelism (cp_size={pc.cp_size}) would "
                             f"get each rank's shard of the logits and labels, and a loss that shifts the labels or "
                             f"averages inside would be the shard's. Compute it in a compute_loss override from "
                             f"inputs['shift_labels'] (shifted before sharding) with num_items_in_batch, or train "
                             f"with cp_size=1.")
        # the Trainer sums the ranks' losses (its num_items_in_batch counts every rank's tokens, its loss is
        # multiplied by the ranks' number): an MoE's load-balancing loss inside the model's is each rank's share
        with losses_summed(), _smoothing_shifted(self, model, inputs.get("shift_labels")):
            return super().compute_loss(model, inputs, *args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        pc = self._cp_config()
        if pc is None or not self._ndp_shards_batch:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        if not has_labels and prediction_loss_only:
            return None, None, None  # no labels, no loss
        labels = None
        if has_labels and not prediction_loss_only:  # the batch's, as the Trainer returns them (before any shift)
            labels = tuple(self._prepare_input(inputs[k]) for k in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        # sharded in place: a copy, so that the caller's batch stays whole (include_for_metrics=["inputs"] reads it)
        inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
        like = inputs.get("input_ids", inputs.get("labels"))
        if not prediction_loss_only and torch.is_tensor(like):
            inputs[ORIGIN] = origin_rows(like)  # where each shard's token goes back
        if has_labels:
            parts, outputs = self._cp_loss_part(model, inputs)
            # this rank's part of its data-parallel batch's loss -> that batch's loss, as a DP-only rank reports it
            part = torch.stack(parts).to(self.args.device, torch.float64)
            dist.all_reduce(part, group=self.accelerator.torch_device_mesh["cp"].get_group())
            loss = (part[0] / part[1].clamp(min=1) + part[2]).float()
        else:
            loss, outputs = None, self._cp_outputs(model, inputs)
        if prediction_loss_only:
            return loss, None, None
        return loss, self._cp_predictions(outputs, ignore_keys, tuple(like.shape)), labels

    def _cp_loss_part(self, model, inputs):
        """((loss, weight, summed), outputs) of this rank's CP shard: the weighted mean of the losses over the CP
        group plus the sum of `summed` is the data-parallel batch's evaluation loss. transformers' loss-only
        evaluation step normalises by the tokens counted before sharding (over the data-parallel ranks, as its own
        step counts them), each shard weighing the same; an MoE's load-balancing loss is in it already (each rank's
        share)."""
        inputs = self._prepare_inputs(inputs)
        loss, _, outputs = self._cp_shard_loss(model, inputs, self._get_num_items_in_batch([inputs], self.args.device))
        return (loss, torch.ones_like(loss), torch.zeros_like(loss)), outputs

    def _cp_shard_loss(self, model, inputs, num_items_in_batch=None):
        """(compute_loss, the shard's labelled tokens (None without labels), the model's outputs where predictions
        are gathered, else None) on this rank's CP shard of a prepared batch, without gradient."""
        cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)
        # the outputs only for predictions: TRL's SFTTrainer runs another forward for them, liger skips the logits
        predicting = self._ndp_origin is not None
        if self.args.use_liger_kernel and not predicting:
            inputs = {**inputs, "skip_logits": True}
        with torch.no_grad(), self.compute_loss_context_manager(), cp_context():
            out = self.compute_loss(model, inputs, return_outputs=predicting, num_items_in_batch=num_items_in_batch)
        loss, outputs = out if predicting else (out, None)
        labels = inputs.get("shift_labels")
        return loss.detach().mean(), None if labels is None else (labels != -100).sum(), outputs

    def _cp_outputs(self, model, inputs):
        """The model's outputs on this rank's CP shard of a batch without labels (predictions)."""
        cp_context, inputs = self._prepare_context_parallel_inputs(model, self._prepare_inputs(inputs))
        with torch.no_grad(), self.compute_loss_context_manager(), cp_context():
            return model(**inputs)

    def _cp_predictions(self, outputs, ignore_keys, shape):
        """The predictions the Trainer returns (the outputs but the loss and `ignore_keys`; one alone is returned
        bare), each per-token output (logits, hidden states) gathered from the CP group into the batch's ``shape``
        and order (``ndp.hf.batch.gather_tokens``), on every rank: what a run without CP returns. An output that is
        not per token (an MoE's router logits, flattened over the shard's tokens; its load-balancing loss) is
        refused by name."""
        items = self._predicted(outputs, ignore_keys)
        origin = self._ndp_origin
        odd = [k for k, v in items if not _per_token(v, origin.shape)]
        if odd:
            raise ValueError(f"ndp.trainer: the model's outputs {odd} are not per-token tensors ([batch, seq, ...] "
                             f"of this rank's shard), which context parallelism (cp_size={self._cp_config().cp_size}) "
                             f"cannot gather back into the batch; the Trainer would return them as predictions. Leave "
                             f"them out: ignore_keys={odd} (evaluate(ignore_keys=...), predict(ignore_keys=...), "
                             f"ignore_keys_for_eval in train), or predict without CP.")
        axis = mesh_axis(self.accelerator.torch_device_mesh, "cp")
        preds = tuple(recursively_apply(lambda t: gather_tokens(t.detach(), origin, shape, axis), v) for _, v in items)
        return preds[0] if len(preds) == 1 else preds

    def _predicted(self, outputs, ignore_keys):
        """(name, value) of what transformers' prediction step returns as predictions: the outputs but the loss and
        `ignore_keys` (by default the model config's ``keys_to_ignore_at_inference``)."""
        if ignore_keys is None:
            ignore_keys = getattr(getattr(self.model, "config", None), "keys_to_ignore_at_inference", ["cache"])
        items = outputs.items() if isinstance(outputs, dict) else enumerate(outputs)
        return [(k, v) for k, v in items if k not in [*ignore_keys, "loss"]]

    def _run_epoch(self, *args, **kwargs):
        resumed = kwargs["epoch"] == kwargs["epochs_trained"] and kwargs["resume_from_checkpoint"] is not None
        skips = resumed and kwargs["steps_trained_in_current_epoch"] > 0 and not self.args.ignore_data_skip
        if skips and redealt_on_skip(kwargs["train_dataloader"]):
            # transformers calls Accelerate's skip_first_batches, which rebuilds the loader dealing one piece per
            # process (the ranks of a data-parallel batch would get different rows); the Accelerator's deals on by
            # data-parallel rank
            with _replaced([sys.modules[transformers.Trainer.__module__]], "skip_first_batches",
                           lambda original: self.accelerator.skip_first_batches):
                return super()._run_epoch(*args, **kwargs)
        return super()._run_epoch(*args, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Accelerate's FSDP2 optimizer load asks for every trainable parameter's state, and a parameter the
        # optimizer held none for at save (never given a gradient: a vision tower under text-only batches; every
        # parameter under plain SGD) stops the resume. Those are loaded as frozen: no state asked for and none made,
        # as in the uninterrupted run.
        saved = saved_optimizer_state(checkpoint) if checkpoint and _fsdp2(self) else None
        if saved is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        fqns, groups = saved
        stateless = [p for n, p in self.model.named_parameters() if p.requires_grad and clean_name(n) not in fqns]
        for p in stateless:
            p.requires_grad_(False)
        try:
            if fqns or groups is None:
                super()._load_optimizer_and_scheduler(checkpoint)
            elif os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
                # no state at all in a full state dict: torch's load finds no device to put none on; the param
                # groups (lr, momentum, ...) are all there is to load
                _load_param_groups(self.optimizer, groups)
                self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME),
                                                             weights_only=True))
        finally:
            for p in stateless:
                p.requires_grad_(True)

    def _track_num_input_tokens(self, inputs):
        # under CP `inputs` are this rank's shard by now (sharded in place, ndp's pads included): the batch is counted
        # from its tensors held before sharding; the Trainer gathers every rank's count, and each data-parallel batch
        # is held whole by its CP and TP ranks: counted once per data-parallel rank, as a run without CP counts it
        seen = self.state.num_input_tokens_seen
        sharded = self._cp_config() is not None and self._ndp_shards_batch
        super()._track_num_input_tokens(self._ndp_unsharded if sharded else inputs)
        self.state.num_input_tokens_seen = seen + (self.state.num_input_tokens_seen - seen) // self._ranks_per_batch()

    def _ranks_per_batch(self) -> int:
        """How many ranks hold each data-parallel batch whole before sharding (its CP and TP ranks; 1 without a
        parallelism_config)."""
        if getattr(self.accelerator, "parallelism_config", None) is None:
            return 1
        return batch_ranks(self.accelerator.torch_device_mesh)

    def _gather_over_dp(self, data):
        """gather_for_metrics over the data-parallel ranks only: one entry per DP rank's batch, the padding of the
        last batch cut off as Accelerate does (each tensor of nested predictions: logits and hidden states)."""
        state, axis = self.accelerator.gradient_state, mesh_axis(self.accelerator.torch_device_mesh, "dp")
        cut = state.remainder if state.end_of_dataloader and state.remainder > 0 else None

        def gather(tensor):
            return gather_over(tensor, axis)[:cut]

        return recursively_apply(gather, data, error_on_other_type=True)


@contextlib.contextmanager
def _smoothing_shifted(trainer, model, shifted):
    """The Trainer's label smoother shifts a causal LM's labels, which it recognises by the class name; FSDP2
    renames the class (``FSDPLlamaForCausalLM``), so under FSDP2 it did not shift (every token trained to predict
    itself, with or without CP), and under CP a shift inside each shard would misplace every shard's edges. For the
    call, a causal LM's labels are shifted as the Trainer means them: the labels shifted before sharding
    (`shifted`: ``shift_labels``, under CP), else shifted by the smoother."""
    smoother = trainer.label_smoother
    if smoother is None:
        yield
        return
    causal = _is_causal_lm(trainer._inner(model))

    def as_meant(outputs, labels, shift_labels=False, num_items_in_batch=None):
        if causal and shifted is not None:
            return smoother(outputs, shifted, num_items_in_batch=num_items_in_batch)
        return smoother(outputs, labels, shift_labels=causal, num_items_in_batch=num_items_in_batch)

    trainer.label_smoother = as_meant
    try:
        yield
    finally:
        trainer.label_smoother = smoother


@contextlib.contextmanager
def _neftune_of_batch(cp_context, trainer, model, seq, shard):
    """NEFTune (``neftune_noise_alpha``) scales its noise by alpha / sqrt(row length x width), the length read from
    the embeddings' output: under CP this rank's shard, sqrt(cp_size) x the batch's noise. Inside the CP context,
    alpha is scaled by sqrt(shard length / the batch's length) for the step: the batch's magnitude."""
    with cp_context():
        on = getattr(trainer, "neftune_noise_alpha", None) is not None
        embeddings = trainer._inner(model).get_input_embeddings() if on else None
        alpha = getattr(embeddings, "neftune_noise_alpha", None)  # None in evaluation: NEFTune trains only
        if alpha is None:
            yield
            return
        embeddings.neftune_noise_alpha = alpha * math.sqrt(shard.shape[1] / seq)  # the buffer, sharded in place
        try:
            yield
        finally:
            embeddings.neftune_noise_alpha = alpha


def _per_token(value, shape) -> bool:
    """A tensor whose leading dims are the shard's ``shape`` ([rows, tokens]), or a tuple / list of them (hidden
    states, one per layer)."""
    if isinstance(value, (tuple, list)):
        return len(value) > 0 and all(_per_token(v, shape) for v in value)
    return torch.is_tensor(value) and tuple(value.shape[:len(shape)]) == tuple(shape)


# The class names of transformers' causal-LM mapping: the Trainer's test for shifting a model's labels.
_CAUSAL_LM_NAMES = frozenset(n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                             for n in ([v] if isinstance(v, str) else v))


def _is_causal_lm(model) -> bool:
    """A class of transformers' causal-LM mapping (the Trainer's test), looked up through FSDP2's renamed class;
    `model` unwrapped (``NdpTrainerMixin._inner``)."""
    return any(c.__name__ in _CAUSAL_LM_NAMES for c in type(model).__mro__)


def _fsdp2(trainer) -> bool:
    return trainer.is_fsdp_enabled and getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2


def _load_param_groups(optimizer, groups) -> None:
    own = optimizer.state_dict()["param_groups"]
    saved, ours = [len(g["params"]) for g in groups], [len(g["params"]) for g in own]
    if saved != ours:
        raise ValueError(f"ndp.trainer: the checkpoint's optimizer has param groups of {saved} parameters, this one "
                         f"{ours}: resume with the optimizer and model the checkpoint was saved with.")
    optimizer.load_state_dict({"state": {},
                               "param_groups": [dict(g, params=o["params"]) for g, o in zip(groups, own)]})


def _need_trl(name) -> None:
    """Raise, naming what to install, where trl is missing: ndp.trainer's `name` subclasses trl's."""
    if trl is None:
        raise ImportError(f"ndp.trainer.{name} subclasses trl.{name}, and trl is not installed: pip install trl (or "
                          f"ndp[hf]). ndp.trainer.Trainer needs no trl.")


def _check_token_loss_trainer(cls, cp_size) -> None:
    """Refuse, at construction on every rank, a TRL trainer whose loss ndp cannot compute from CP shards: under CP
    each rank holds a shard of every sequence, exact for a sum over tokens (transformers.Trainer's loss,
    trl.SFTTrainer's) and for DPO's and KTO's on :class:`NdpSequenceLossMixin` (each call's per-token outputs
    gathered back), not for what TRL's other trainers compute per sequence (a reward model's pooled score, GKD's
    teacher run on the shard) nor for DPO or KTO on the mixin alone."""
    owner = next((c for c in cls.__mro__ if "compute_loss" in vars(c) and c.__module__.split(".")[0] == "trl"), None)
    if owner is None:  # no TRL loss (transformers' Trainer, or no trl installed)
        return
    mixin = {trl.DPOTrainer: NdpSequenceLossMixin, trl.KTOTrainer: NdpSequenceLossMixin,
             trl.RewardTrainer: RewardTrainer}.get(owner)
    if owner is trl.SFTTrainer or (mixin is not None and issubclass(cls, mixin)):
        return
    how = f"Use ndp.trainer.{owner.__name__} (it runs it under CP), or train" if mixin else "Train"
    raise ValueError(f"ndp.trainer: {cls.__name__} takes its loss from {owner.__module__}.{owner.__qualname__}, "
                     f"which ndp's context parallelism (cp_size={cp_size}) cannot compute from each rank's shard "
                     f"of the sequences (ndp serves a sum over tokens: transformers.Trainer's loss, "
                     f"trl.SFTTrainer's; DPO, KTO and reward modelling on ndp.trainer.DPOTrainer, KTOTrainer and "
                     f"RewardTrainer). {how} it with cp_size=1 (data, tensor or fully sharded parallelism only).")


def _check_token_batch(inputs, cp_size) -> None:
    """Refuse, before any sharding, a CP batch ndp cannot shard by its tokens: every CP rank holds the same batch,
    so each raises here before any communication."""
    if torch.is_tensor(inputs.get("inputs_embeds")):
        raise ValueError(f"ndp.trainer: a batch of inputs_embeds (shape {tuple(inputs['inputs_embeds'].shape)}) under "
                         f"context parallelism (cp_size={cp_size}): ndp shards [batch, seq] token tensors, and "
                         f"embeddings left whole would meet sharded labels and positions. Pass input_ids (the "
                         f"model embeds each rank's shard), or train this batch with cp_size=1.")
    if not any(torch.is_tensor(inputs.get(k)) and inputs[k].dim() == 2 for k in ("input_ids", "labels")):
        got = {k: tuple(v.shape) if torch.is_tensor(v) else type(v).__name__ for k, v in inputs.items()}
        raise ValueError(f"ndp.trainer: under context parallelism (cp_size={cp_size}) a batch needs [batch, seq] "
                         f"input_ids or labels (the per-token tensors are sharded by their shape); got {got}")


class NdpPooledScoreMixin(NdpTrainerMixin):
    """The overrides that put a trainer of a model whose head reads chosen positions of each row on ndp's context
    parallelism: transformers' sequence classification (one score per row, read at the row's last real token: a
    classifier under :class:`Trainer`, a reward model under :class:`RewardTrainer`) and question answering (a span's
    start and end over the row, under :class:`Trainer`).

    Under CP each rank would hold a shard of the row, and transformers' head would read the shard's positions.
    As for DPO (:class:`NdpSequenceLossMixin`), the trainer's batch stays whole and each model call runs on this
    rank's shard of its tensors (a right-padded batch's mask made all ones: the pooled token is real, and no real
    token sees a pad under the causal mask); the head's per-token output (its Linear's: ``ndp.hf.models.row_head``)
    is gathered back into the batch's rows (``gather_tokens``, differentiable) and read as transformers reads it
    (pooled at the last non-pad token: ``ndp.hf.models.pooled_last_token``; split into start and end logits),
    replacing the shard's; a call's labels (``labels``, ``start_positions`` / ``end_positions``) are held back and
    the model's own loss is computed on the whole rows: the loss, its gradient and every metric are the batch's, on
    every CP rank (a shard's gradient is every CP rank's gradient of its tokens, summed, so FSDP's average over the
    dp x cp ranks is the data-parallel batches' mean). The outputs are whole on every rank, so evaluation
    predictions are served. A model without such a head is refused by name at construction where the trainer serves
    nothing else (``_ndp_pooled_only``: :class:`RewardTrainer`, sequence classification only), else trained as the
    mixin's base class trains it (a per-token head; a head of its own that pools is refused by the CP model check).
    Refused by name in a call: positional arguments, hidden states or attentions asked for, a padded
    question-answering batch (its pads' logits are read).
    """

    _ndp_pooled_only = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pc = self._cp_config()
        if pc is None:
            return
        head = row_head(self.model)
        if head == "score" or (head and not self._ndp_pooled_only):
            self._ndp_pools, self._ndp_shards_batch = True, False
            setattr(self.model, POOLED_ON_WHOLE, True)  # the CP check's pooling-head refusal does not apply
        elif self._ndp_pooled_only:
            raise ValueError(f"ndp.trainer: {type(self).__name__} under context parallelism (cp_size="
                             f"{pc.cp_size}) pools each row's score from the gathered per-token scores of "
                             f"transformers' sequence-classification head (GenericForSequenceClassification: a "
                             f"`score` Linear, pooled at the last non-pad token); {type(self.model).__name__}'s "
                             f"head is not one. Train it with cp_size=1.")

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # a batch without labels is predicted by a model call outside compute_loss: sharded too
        with self._calls_on_shards(*self._sharded_models(model)):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _shard_call(self, pc, calls, model, args, kwargs):
        """Forward pre-hook: the call's [batch, seq] tensors sharded, the CP context entered, the head's per-token
        scores and the call's labels held for :meth:`_gather_call`."""
        asked = [k for k in ("output_hidden_states", "output_attentions") if kwargs.get(k)]
        if args or calls or asked or not torch.is_tensor(kwargs.get("input_ids")):
            raise ValueError(f"ndp.trainer: under context parallelism (cp_size={pc.cp_size}) {type(self).__name__} "
                             f"calls the model with input_ids by keyword and pools its scores from the gathered "
                             f"sequence; this call has {asked or 'positional arguments, or no input_ids'}, which "
                             f"would be each shard's. Call it with input_ids, attention_mask and labels only, or "
                             f"with cp_size=1.")
        # TRL hands the batch's margin column to the model too, which passes it on to the attention unread (ndp's
        # attention refuses an argument it does not know): the loss reads it from the batch, not from the call
        _refuse_padded_spans(pc, model, kwargs.get("attention_mask"))
        labels = {k: kwargs[k] for k in _ROW_LABELS if kwargs.get(k) is not None}
        kwargs = self._on_shard(pc, calls, model, {k: v for k, v in kwargs.items() if k not in ("margin", *labels)})
        held = []
        inner = self._inner(model)
        head = getattr(inner, row_head(inner))
        calls[-1][0].callback(head.register_forward_hook(lambda m, a, out: held.append(out)).remove)
        calls[-1] += (held, labels)
        return args, kwargs

    def _gather_call(self, pc, calls, model, args, kwargs, output):
        """Forward hook: the CP context left; the held per-token scores gathered into the batch's rows and pooled
        as transformers pools them, in place of the shard's pooled scores."""
        if not calls:  # a pre-hook refused the call
            return None
        stack, origin, like, held, labels = calls.pop()
        stack.close()
        if output is None:  # the forward raised
            return None
        whole = gather_tokens(held[-1], origin, tuple(like.shape), mesh_axis(self.accelerator.torch_device_mesh, "cp"))
        return type(output)(**_read_rows(self._inner(model), whole, like, labels))


# what a row head's forward takes as labels (sequence classification's; question answering's span)
_ROW_LABELS = ("labels", "start_positions", "end_positions")


def _refuse_padded_spans(pc, model, mask) -> None:
    """Question answering reads every position's start and end logits, the pads' included (transformers' loss and
    predictions do not mask them), and under CP the pads' outputs are computed without the padding mask (its keys
    are not masked: ``ndp.hf.batch.without_padding``): a padded batch is refused, on every CP rank alike."""
    if row_head(model) != "qa_outputs" or not torch.is_tensor(mask) or bool(mask.all()):
        return
    raise ValueError(f"ndp.trainer: under context parallelism (cp_size={pc.cp_size}) a question-answering batch "
                     f"with padding ({int((mask == 0).sum())} pad tokens in the attention_mask): its start and end "
                     f"logits at the pads, which the loss and predictions read, would differ from a run without CP "
                     f"(ndp drops the padding mask). Give it unpadded rows (per_device_train_batch_size=1, or rows all "
                     f"of one length), or train with cp_size=1.")


def _read_rows(model, scores, input_ids, labels) -> dict:
    """What transformers' row head (``ndp.hf.models.row_head``) returns from its Linear's per-token `scores` of the
    whole rows: sequence classification's pooled logits, question answering's start and end logits; with `labels`
    (its forward's), the model's own loss on them."""
    if row_head(model) == "qa_outputs":
        start, end = (t.squeeze(-1).contiguous() for t in scores.split(1, dim=-1))
        out = {"start_logits": start, "end_logits": end}
        if "start_positions" in labels and "end_positions" in labels:
            out["loss"] = model.loss_function(start, end, labels["start_positions"], labels["end_positions"])
        return out
    out = {"logits": pooled_last_token(model, scores, input_ids)}
    if "labels" in labels:
        out["loss"] = model.loss_function(logits=scores, labels=labels["labels"], pooled_logits=out["logits"],
                                          config=model.config)
    return out


class Trainer(NdpPooledScoreMixin, transformers.Trainer):
    """``transformers.Trainer`` with ndp's context parallelism (see the module docstring): a sequence classifier
    and question answering under CP on :class:`NdpPooledScoreMixin`, a classifier's loss counted as the Trainer
    means (:func:`_count_classifier_loss`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _count_classifier_loss(self)


def _count_classifier_loss(trainer) -> None:
    """transformers' token- and sequence-classification heads take ``**kwargs``, so the Trainer hands them
    ``num_items_in_batch`` and, trusting them to divide by it, neither divides their loss by the gradient-accumulation
    steps nor keeps it from being multiplied by the number of processes; they drop it and return their call's mean,
    so the loss and its gradient come out gradient_accumulation_steps x world_size times too large. A token
    classifier's loss is computed from its logits with the count instead (transformers' ``ForTokenClassification``
    given ``num_items_in_batch``: the mean over every labelled token of the step, on CP shards too), unless the user
    set a ``compute_loss_func`` or label smoothing (which takes the count); a sequence classifier's (and question
    answering's, which the Trainer counts nothing for) is its call's mean, which the Trainer then averages over the
    calls (``model_accepts_loss_kwargs = False``)."""
    model = trainer.model
    if classifies_tokens(model) and trainer.compute_loss_func is None and trainer.label_smoother is None:
        trainer._ndp_token_loss = functools.partial(_token_loss, peft_inner(model).config)
        trainer.compute_loss_func = trainer._ndp_token_loss
    elif row_head(model):
        trainer.model_accepts_loss_kwargs = False


def _token_loss(config, outputs, labels, num_items_in_batch=None):
    """A token classifier's loss from its outputs' logits: summed over the labelled tokens and divided by
    `num_items_in_batch`, else their mean (the Trainer's ``compute_loss_func``)."""
    return ForTokenClassification(outputs["logits"], labels, config, num_items_in_batch=num_items_in_batch)


class SFTTrainer(NdpTrainerMixin, trl.SFTTrainer if trl is not None else object):
    """``trl.SFTTrainer`` with ndp's context parallelism, ``packing=True`` included.

    TRL refuses packing (``packing`` or ``eval_packing``) with ``cp_size > 1`` because torch's CP drops the
    per-document mask; ndp's attention keeps the documents apart (the packed rows are sharded per document, the
    document table reaches every layer), so this class lets it through: TRL's constructor sees ``packing=False,
    eval_packing=None, padding_free=True, max_length=None`` (the collator packing needs) and ``_prepare_dataset``
    (overridden) still prepares each dataset as configured: the training data packed or not as ``packing`` says,
    the evaluation data as ``eval_packing`` (else ``packing``) says, each with the configured strategy and length;
    the arguments read as given again afterwards. TRL's fused LM head takes the ``shift_labels`` the mixin makes
    before sharding. Its ``num_tokens`` metric counts each data-parallel batch before sharding (``compute_loss``).
    """

    def __init__(self, model=None, args=None, *rest, **kwargs):
        _need_trl("SFTTrainer")
        pc = getattr(args, "parallelism_config", None)
        self._ndp_packing = None
        if args is not None and (args.packing or args.eval_packing) and pc is not None and pc.cp_enabled:
            # what the constructor must not see; max_length too: TRL refuses it for padding-free rows not packed
            self._ndp_packing = {name: getattr(args, name) for name in _PACKING_ARGS}
            args.packing, args.eval_packing, args.padding_free, args.max_length = False, None, True, None
        try:
            super().__init__(model, args, *rest, **kwargs)
        finally:
            if self._ndp_packing:
                for name in _PACKING_ARGS:
                    setattr(args, name, self._ndp_packing[name])
            self._ndp_packing = None  # past the constructor, TRL's own preparation reads the arguments as given

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        given = self._ndp_packing
        if given is None:
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        # the constructor prepares the training data (named "train") first, then each evaluation dataset
        train = dataset_name == "train" and not given.get("train_done")
        given["train_done"] = given.get("train_done") or train
        packing = given["packing"] if train or given["eval_packing"] is None else given["eval_packing"]
        held = args.max_length
        args.max_length = given["max_length"]  # the packed blocks' length, or the truncation's
        try:
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        finally:
            args.max_length = held

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        counted = self._total_train_tokens
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        # TRL counts the training tokens (its num_tokens metric) of the batch it gets, gathered from every rank: under
        # CP each rank's shard, ndp's pads included, a padded batch's mask made all ones; each batch once per CP and
        # TP rank. Counted here from the batch's unsharded tensors, once per data-parallel rank
        held = self._ndp_unsharded if self._cp_config() is not None else inputs
        tokens = _trl_batch_tokens(held) if self._ranks_per_batch() > 1 else None
        if tokens is not None and self.model.training:
            tokens = self.accelerator.gather(tokens.to(self.args.device)).sum().item()
            self._total_train_tokens = counted + tokens // self._ranks_per_batch()
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return out

    def _cp_loss_part(self, model, inputs):
        # TRL's own evaluation step counts no tokens before the loss: each batch is normalised by its own labelled
        # tokens, so each shard's token loss weighs by its own; an MoE's load-balancing loss (TRL adds coef x
        # aux_loss, each rank's share x cp_size) is the sum of the shares
        with recorded_shares() as shares:
            loss, labelled, outputs = self._cp_shard_loss(model, self._prepare_inputs(inputs))
        aux = self.router_aux_loss_coef * shares[-1] if shares and self.aux_loss_enabled else torch.zeros_like(loss)
        loss = loss - aux * self._cp_config().cp_size
        return (loss * labelled, labelled.to(loss.dtype), aux.to(loss.dtype)), outputs

    def _predicted(self, outputs, ignore_keys):
        # TRL's prediction step returns the logits alone (ignore_keys unused)
        return [("logits", outputs.logits)]


_PACKING_ARGS = ("packing", "eval_packing", "padding_free", "max_length")


def _trl_batch_tokens(inputs):
    """A batch's tokens as trl.SFTTrainer counts them (its attention mask's ones, else the padding-free row's
    length), None where TRL counts none."""
    if torch.is_tensor(inputs.get("attention_mask")):
        return inputs["attention_mask"].sum()
    if torch.is_tensor(inputs.get("position_ids")):
        return torch.tensor(inputs["position_ids"].size(1))
    return None


class NdpSequenceLossMixin(NdpTrainerMixin):
    """The overrides that put a TRL trainer whose loss is per sequence (DPO's, KTO's) on ndp's context parallelism.

    DPO's and KTO's losses are non-linear functions of each completion's summed log-probabilities and the reference
    model's, so a rank's shard of the sequences cannot compute them. Under CP, TRL's loss and metrics run on the
    whole batch, alike on every CP rank; each model call inside them (the policy's, the reference model's, KTO's
    mismatched KL pairs', the reference log-probabilities' precomputation) runs on this rank's shard of its own
    tensors (the labels shifted before sharding, a right-padded batch's mask made all ones:
    ``ndp.hf.batch.without_padding``), and the per-token outputs of TRL's fused LM head are gathered back into the
    batch (``gather_tokens``; differentiable: a shard's gradient is every CP rank's gradient of its tokens, summed,
    so FSDP's average over the dp x cp ranks is the gradient of the data-parallel batches' mean loss). An MoE's
    load-balancing loss (each rank's share x cp_size) becomes its batch's on every rank (``ndp.cp.sum_over_group``).
    A reference model TRL shards with FSDP2 itself is split by ndp's TP first (``prepare_fsdp`` replaced in TRL's
    trainer module while the trainer is built: :func:`_reference_split_first`) and gets ndp's CP on its first call.
    The Accelerator's ``gather_for_metrics`` takes each data-parallel batch's values once (``whole_batch_metrics``),
    and TRL's token count is not divided by tp_size (ndp's gather counts no TP copy). Refused under CP, by name: a
    model call without the fused LM head (the logits TRL recomputes for ``compute_metrics`` and ``predict``,
    deprecated by TRL).
    """

    _ndp_shards_batch = False

    def __init__(self, *args, **kwargs):
        _need_trl(type(self).__name__)
        with _reference_split_first(type(self)):
            super().__init__(*args, **kwargs)
        if isinstance(self.accelerator, Accelerator):
            self._tp_size = 1  # TRL divides its gathered token count by tp_size: ndp's gather counts no TP copy

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if isinstance(self.accelerator, Accelerator):
            self.accelerator.whole_batch_metrics = self._cp_config() is not None

    def _sharded_models(self, model) -> tuple:
        return model, getattr(self, "ref_model", None)  # a reward model has none

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        pc = self._cp_config()
        if pc is not None and not prediction_loss_only and not self._ndp_pools:  # before TRL's forwards: refused
            raise _unfused(pc.cp_size, "the logits asked for (prediction_loss_only=False)")  # on every rank alike
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def compute_ref_log_probs(self, model, inputs):
        with self._calls_on_shards(model):
            return super().compute_ref_log_probs(model, inputs)

    def _shard_call(self, pc, calls, model, args, kwargs):
        """Forward pre-hook: the call's [batch, seq] tensors and labels (shifted first) sharded; the CP context
        entered until :meth:`_gather_call`."""
        if calls:  # inside its own forward: TRL's fused head found no backbone (base_model is the model itself)
            raise ValueError(f"ndp.trainer: {type(model).__name__} was called again inside its own forward: TRL's "
                             f"fused LM head runs the model's base_model as its backbone, and this model's "
                             f"base_model is the model itself (TRL's trainer fails on it without CP too: its "
                             f"output has no last_hidden_state). Train this family with the SFT loss, or load it "
                             f"as a class whose base_model is its decoder.")
        if args or not kwargs.get("fused_lm_head") or not torch.is_tensor(kwargs.get("labels")):
            raise _unfused(pc.cp_size, "positional arguments" if args else "no fused LM head or no labels")
        kwargs = dict(kwargs)
        labels = kwargs.pop("labels")
        return args, self._on_shard(pc, calls, model, kwargs, shift_labels=F.pad(labels[:, 1:], (0, 1), value=-100))

    def _gather_call(self, pc, calls, model, args, kwargs, output):
        """Forward hook: the CP context left; each per-token output of the shard gathered into the batch's rows
        (without the last position: TRL's unshifted call returns seq - 1), the load-balancing loss made the
        batch's, the shard's own loss dropped (TRL's preference losses read the per-token outputs)."""
        if not calls:  # a pre-hook refused the call
            return None
        stack, origin, like = calls.pop()
        stack.close()
        if output is None:  # the forward raised
            return None
        axis = mesh_axis(self.accelerator.torch_device_mesh, "cp")
        fields = {k: gather_tokens(v, origin, tuple(like.shape), axis)[:, :-1] if _per_token(v, origin.shape) else v
                  for k, v in output.items() if k != "loss"}
        if torch.is_tensor(fields.get("aux_loss")):
            fields["aux_loss"] = sum_over_group(fields["aux_loss"] / pc.cp_size, axis.get_group())
        return type(output)(**fields)


class DPOTrainer(NdpSequenceLossMixin, trl.DPOTrainer if trl is not None else object):
    """``trl.DPOTrainer`` with ndp's context parallelism (:class:`NdpSequenceLossMixin`)."""


class KTOTrainer(NdpSequenceLossMixin, trl.KTOTrainer if trl is not None else object):
    """``trl.KTOTrainer`` with ndp's context parallelism (:class:`NdpSequenceLossMixin`)."""


class RewardTrainer(NdpPooledScoreMixin, NdpSequenceLossMixin, trl.RewardTrainer if trl is not None else object):
    """``trl.RewardTrainer`` with ndp's context parallelism (:class:`NdpPooledScoreMixin`)."""

    _ndp_pooled_only = True


@contextlib.contextmanager
def _replaced(modules, name: str, make):
    """While inside: the function `name` of each of `modules` (a library's own, which its code calls by name)
    replaced by ``make(original)``."""
    originals = [getattr(m, name) for m in modules]
    for m, original in zip(modules, originals):
        setattr(m, name, make(original))
    try:
        yield
    finally:
        for m, original in zip(modules, originals):
            setattr(m, name, original)


def _reference_split_first(cls):
    """While TRL's trainer `cls` is built: the reference model it shards with FSDP2 itself (``prepare_fsdp``, called
    by name in its trainer's module) is split by ndp's TP first (``Accelerator.prepare_tp``), as the policy is; left
    whole, every TP rank held and ran the whole reference model."""
    modules = [sys.modules[m] for m in {c.__module__ for c in cls.__mro__ if c.__module__.startswith("trl.")}]

    def split_first(original):
        def prepare(model, accelerator):
            return original(accelerator.prepare_tp(model) if isinstance(accelerator, Accelerator) else model,
                            accelerator)
        return prepare

    return _replaced([m for m in modules if callable(getattr(m, "prepare_fsdp", None))], "prepare_fsdp", split_first)


def _unfused(cp_size, what) -> ValueError:
    """NdpSequenceLossMixin's refusal of a model call under CP that TRL's fused LM head does not serve."""
    return ValueError(f"ndp.trainer: under context parallelism (cp_size={cp_size}) each model call inside "
                      f"TRL's loss runs on a shard of the sequences with TRL's fused LM head (keyword arguments, "
                      f"fused_lm_head=True, labels=...), whose per-token log-probabilities ndp gathers back; this "
                      f"one has {what}: the logits TRL recomputes for compute_metrics or predict (deprecated by "
                      f"TRL), which ndp does not gather. Evaluate without compute_metrics, or with cp_size=1.")
