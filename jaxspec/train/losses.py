"""Training objectives of the draft heads, as pure functions of (trainable, fixed, batch, key).

Batch (from the feature store or the online target forward), sequences padded to L:
  tokens [B, L] int32, lengths [B], starts [B] (first response position), hidden [B, L, d] (target's
  post-norm final hidden), layers [B, L, k * d] (EAGLE-3's captured layers); optionally offset [B], the
  position of slot 0 when the batch is a window cropped from longer sequences (lengths/starts relative).
Only response tokens are labels: a prediction of the token at position p counts when
starts <= p < lengths. `fixed` holds the frozen target parameters ("target") and the head's non-trained
variables ("head_fixed", e.g. EAGLE-3's vocabulary maps). Every objective returns
(loss, {"depth_loss": [D], "depth_acc": [D]}), depth j (0-based) being draft depth j + 1; accuracy is
top-1 agreement with the label (hard-label heads) or with the target's argmax (EAGLE's soft labels;
EAGLE-3: the argmax within the draft vocabulary).

  Medusa-1  head j at hidden h_i predicts t_(i+2+j); cross entropy per head (hard self-distilled labels).
  EAGLE-1   pair i = (f_i + uniform noise, t_(i+1)) -> predicted f_(i+1): SmoothL1 to the target feature
            + 0.1 x soft cross entropy against the target's distribution at i + 1 (its LM head). With
            depth > 1, EAGLE-3's training-time test (as HASS does for EAGLE-1/2): step s feeds pair i
            the head's own step s - 1 prediction and t_(i+1+s), predicts f_(i+1+s), weighted 0.8^s.
  EAGLE-3   training-time test: step s feeds pair i the head's own step s - 1 output and t_(i+1+s) at
            rotary position i + s; queries see step 0's keys causally and their own earlier steps'
            keys at the same position (the drafting pattern); soft CE over the draft vocabulary
            (target renormalised there) weighted 0.8^s, mixed with CE to the target's argmax when
            `argmax_weight` > 0 (the token a greedy chain must draft). As in the reference training (EAGLE-3,
            SpecForge), a position counts only where the target's argmax over its full vocabulary
            lies inside the draft vocabulary (the position mask): elsewhere the head could not draft
            the target's token anyway. The argmax comes from the batch ("argmax", written by the
            feature store) or, without it, from the target's full LM head at the sampled positions.
  MTP       module s at position i reads (t_(i+s+1), h_i^s) and predicts t_(i+s+2); CE per depth; with
            `backbone_weight` > 0 the target is trained too: main next-token CE + lambda x MTP loss.
The target's LM head over the full vocabulary dominates the cost on a CPU, so the Medusa, EAGLE-1 and
MTP cross entropies are taken at `num_positions` positions per sequence drawn from the valid ones; so are
EAGLE-3's (per TTT step; its head still runs every position, since later steps read them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.drafters.heads.configs import Eagle3Config, EagleConfig, HeadConfig, MedusaConfig, MtpConfig
from jaxspec.drafters.heads.layers import AttentionInputs, causal_visible, empty_cache_inputs
from jaxspec.drafters.heads.medusa.module import medusa_logits
from jaxspec.drafters.heads.mtp.module import mtp_module_forward
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import embed_tokens, lm_logits

EAGLE_VALUE_WEIGHT = 1.0
EAGLE_PROB_WEIGHT = 0.1
UNROLL_STEP_DECAY = 0.8  # training-time-test step s of EAGLE-3 and EAGLE-1 weighs 0.8^s
# Ranks a Medusa head's rank accuracies cover (`rank_acc`; a calibrated tree uses top-k <= this). The
# first head's ranks 10-19 are each still right more often (~0.6-1.1% of positions) than the last
# deeper paths a tree of 31 or 63 takes (~0.2-0.4%), so a cap of 10 ranks would leave them out.
MEDUSA_CALIBRATION_RANKS = 20
# ... and the joint ranks of its first heads (`path_acc`, [R + 1] ** J; heads are wrong together).
MEDUSA_JOINT_HEADS = 3


def label_mask(batch: dict[str, jax.Array], offset: int, n: int) -> jax.Array:
    """[B, n] True where position i's label t_(i + offset) is a response token."""
    p = jnp.arange(n)[None, :] + offset
    return (p >= batch["starts"][:, None]) & (p < batch["lengths"][:, None])


def batch_positions(batch: dict[str, jax.Array], n: int) -> jax.Array:
    """[B, n] rotary positions of a batch's first n slots: its window "offset" (0 uncropped) + index."""
    offset = batch.get("offset", jnp.zeros_like(batch["lengths"]))
    return offset[:, None] + jnp.arange(n)[None, :]


def shifted(x: jax.Array, shift: int, n: int) -> jax.Array:
    """x [B, L, ...] -> [B, n, ...] with row i = x[:, i + shift] (zeros past the end)."""
    pad = [(0, 0), (0, max(0, shift + n - x.shape[1]))] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad)[:, shift : shift + n]


def sample_positions(key: jax.Array, valid: jax.Array, num: int) -> tuple[jax.Array, jax.Array]:
    """valid [B, N] -> (indices [B, P], weight [B, P]): P = min(num, N) distinct valid positions per row
    drawn uniformly (fewer valid ones: the rest get weight 0)."""
    if num >= valid.shape[1]:
        idx = jnp.broadcast_to(jnp.arange(valid.shape[1]), valid.shape)
        return idx, valid.astype(jnp.float32)
    scores = jnp.where(valid, jax.random.uniform(key, valid.shape), -1.0)
    top, idx = jax.lax.top_k(scores, num)
    return idx, (top >= 0).astype(jnp.float32)


def take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, N, ...], idx [B, P] -> [B, P, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def masked_mean(values: jax.Array, weight: jax.Array) -> jax.Array:
    return (values * weight).sum() / jnp.maximum(weight.sum(), 1.0)


def hard_ce(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [..., V], labels [...] -> (cross entropy [...], top-1 correct [...] float)."""
    logits = logits.astype(jnp.float32)
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return ce, (jnp.argmax(logits, -1) == labels).astype(jnp.float32)


def label_rank(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """logits [..., V], labels [...] -> [...] int32: how many tokens score above the label (0 = top-1)."""
    logits = logits.astype(jnp.float32)
    label_logit = jnp.take_along_axis(logits, labels[..., None], -1)
    return (logits > label_logit).sum(-1).astype(jnp.int32)


def soft_ce(logits: jax.Array, target_probs: jax.Array) -> jax.Array:
    """-sum_v p(v) log q(v): logits [..., V], target_probs [..., V] -> [...]."""
    return -(target_probs * jax.nn.log_softmax(logits.astype(jnp.float32), -1)).sum(-1)


def smooth_l1(pred: jax.Array, target: jax.Array) -> jax.Array:
    """Mean over the last axis of the Huber loss with beta 1 (PyTorch's SmoothL1Loss)."""
    diff = jnp.abs(pred.astype(jnp.float32) - target.astype(jnp.float32))
    return jnp.where(diff < 1.0, 0.5 * diff**2, diff - 0.5).mean(-1)


def unrolled_attention_inputs(
    b: int, layer: Any, n: int, keys: list[jax.Array], values: list[jax.Array], dtype: jnp.dtype
) -> AttentionInputs:
    """The attention inputs of training-time-test step s = len(keys) over n pairs: step 0 attends
    causally within itself (the target-feature pass); step s >= 1 sees step 0's keys causally and each
    earlier step's key at its own position only, the pattern a chain drafted from every position would
    see. keys / values: steps 0..s-1's [1, B, kv_heads, n, head_dim], as the heads return them."""
    if not keys:
        return empty_cache_inputs(b, layer.num_kv_heads, layer.head_dim, causal_visible(n), dtype)
    s = len(keys)
    eye = jnp.eye(n, dtype=bool)
    visible = jnp.concatenate([causal_visible(n)] + [eye] * (s - 1), axis=1)
    empty = jnp.zeros((b, layer.num_kv_heads, 0, layer.head_dim), dtype)
    return AttentionInputs(
        empty, empty, jnp.zeros((b, 1, 0), bool), eye,
        jnp.concatenate(keys, axis=-2), jnp.concatenate(values, axis=-2),
        jnp.broadcast_to(visible, (b, n, n * s)),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Objective:
    """A head's training loss; static to `jax.jit` (graphdefs and configs only, no arrays).

    num_positions: loss positions per sequence (all valid ones when >= the sequence length).
    depth: draft depths trained (Medusa: its heads; EAGLE-3 and EAGLE-1: TTT steps; MTP: chained modules).
    noise: EAGLE-1 uniform feature noise width (U(-noise/2, noise/2)).
    backbone_weight: MTP only, > 0 trains the target too: main CE + backbone_weight x MTP loss.
    soft_weight: Medusa and MTP: the loss per depth is (1 - w) x CE to the self-distilled token + w x soft
      CE to the target's own distribution at that position (KL up to the target's entropy), so the head
      learns the target's whole distribution, not only its top-1 (EAGLE and EAGLE-3 are soft already).
    argmax_weight: EAGLE-3: the loss per step is (1 - w) x soft CE over the draft vocabulary + w x CE to
      the target's argmax there (one-hot), the only token a greedy draft is accepted on; 0 is the
      reference training (soft only).
    """

    head_graphdef: nnx.GraphDef
    head_config: HeadConfig
    target_graphdef: nnx.GraphDef
    target_config: ModelConfig
    depth: int
    num_positions: int = 32
    noise: float = 0.2
    backbone_weight: float = 0.0
    soft_weight: float = 0.0
    argmax_weight: float = 0.0

    @property
    def method(self) -> str:
        from jaxspec.drafters.heads.configs import method_of

        return method_of(self.head_config)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.head_config.target_layers if isinstance(self.head_config, Eagle3Config) else ()

    def __call__(
        self, trainable: dict[str, Any], fixed: dict[str, Any], batch: dict[str, jax.Array], key: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        target_params = trainable.get("backbone", fixed["target"])
        if "backbone" in trainable:
            from jaxspec.train.features import target_features

            hidden, _ = target_features(
                self.target_graphdef, target_params, batch["tokens"], config=self.target_config,
                stop_gradient=False, cache=fixed.get("empty_cache"),
            )  # fmt: skip
            batch = dict(batch, hidden=hidden)
        head_params = nnx.merge_state(trainable["head"], fixed.get("head_fixed", nnx.State({})))

        def target_lm(x: jax.Array) -> jax.Array:
            return lm_logits(self.target_graphdef, target_params, x)

        def target_embed(t: jax.Array) -> jax.Array:
            return embed_tokens(self.target_graphdef, target_params, t)

        config = self.head_config
        if isinstance(config, MedusaConfig):
            return self._medusa(head_params, batch, key, target_lm)
        if isinstance(config, EagleConfig):
            return self._eagle(head_params, batch, key, target_lm, target_embed)
        if isinstance(config, Eagle3Config):
            return self._eagle3(head_params, batch, key, target_lm, target_embed)
        if isinstance(config, MtpConfig):
            return self._mtp(head_params, batch, key, target_lm, target_embed)
        raise TypeError(f"Objective: unknown head config {config!r}")

    def _mixed_ce(self, logits, labels, hidden, idx, shift, target_lm):
        """Per-position (loss, top-1 correct) at depth label t_(i + shift): hard CE to the label, mixed with
        soft CE to the target's distribution at position i + shift - 1 when soft_weight > 0."""
        ce, correct = hard_ce(logits, labels)
        if self.soft_weight > 0.0:
            target = jax.lax.stop_gradient(target_lm(take(shifted(hidden, shift - 1, hidden.shape[1]), idx)))
            soft = soft_ce(logits, jax.nn.softmax(target.astype(jnp.float32), -1))
            ce = (1.0 - self.soft_weight) * ce + self.soft_weight * soft
        return ce, correct

    def _medusa(self, params, batch, key, target_lm):
        hidden, tokens = batch["hidden"], batch["tokens"]
        n = hidden.shape[1]
        idx, weight = sample_positions(key, label_mask(batch, 2, n), self.num_positions)
        logits = medusa_logits(self.head_graphdef, params, take(hidden, idx), target_lm)  # [B, P, K, V]
        losses, accs, rank_accs, clipped_ranks = [], [], [], []
        r = MEDUSA_CALIBRATION_RANKS
        for j in range(self.depth):
            labels = take(shifted(tokens, 2 + j, n), idx)
            w = weight * take(label_mask(batch, 2 + j, n), idx)
            ce, correct = self._mixed_ce(logits[:, :, j], labels, hidden, idx, 2 + j, target_lm)
            losses.append(masked_mean(ce, w))
            accs.append(masked_mean(correct, w))
            rank = label_rank(logits[:, :, j], labels)
            rank_accs.append((jax.nn.one_hot(rank, r) * w[..., None]).sum((0, 1)) / jnp.maximum(w.sum(), 1.0))
            clipped_ranks.append((jnp.minimum(rank, r), w))
        depth_loss = jnp.stack(losses)
        # rank_acc [K, R]: head j's rank-r token is the label; path_acc [R + 1] * J: the first J heads'
        # labels sit at ranks (r_1, .., r_J), R = "R or worse", over positions where all J have a label
        # (the inputs of a calibrated Medusa tree, `TreeCalibration`).
        joint_heads = min(self.depth, MEDUSA_JOINT_HEADS)
        joint_index = sum(clipped_ranks[j][0] * (r + 1) ** (joint_heads - 1 - j) for j in range(joint_heads))
        w = clipped_ranks[joint_heads - 1][1]
        joint = jax.nn.one_hot(joint_index, (r + 1) ** joint_heads) * w[..., None]
        metrics = {
            "depth_loss": depth_loss, "depth_acc": jnp.stack(accs), "rank_acc": jnp.stack(rank_accs),
            "path_acc": (joint.sum((0, 1)) / jnp.maximum(w.sum(), 1.0)).reshape((r + 1,) * joint_heads),
        }  # fmt: skip
        return depth_loss.sum(), metrics

    def _eagle(self, params, batch, key, target_lm, target_embed):
        head = nnx.merge(self.head_graphdef, params)
        hidden, tokens = batch["hidden"], batch["tokens"]
        b, n = tokens.shape[0], tokens.shape[1] - 1
        noise_key, pos_key = jax.random.split(key)
        features = hidden[:, :n]
        noise = (jax.random.uniform(noise_key, features.shape, features.dtype) - 0.5) * self.noise
        features = features + noise
        layer = self.head_config.layer
        keys, values = [], []
        value_losses, prob_losses, accs = [], [], []
        for s in range(self.depth):
            inputs = unrolled_attention_inputs(b, layer, n, keys, values, features.dtype)
            pred, k, v = head(
                head.embed(shifted(tokens, 1 + s, n), target_embed), features, batch_positions(batch, n) + s,
                inputs,
            )  # fmt: skip
            keys.append(k)
            values.append(v)
            target_features = shifted(hidden, 1 + s, n)  # pair i's step-s prediction is f_(i + 1 + s)
            valid = label_mask(batch, 2 + s, n)
            value_losses.append(masked_mean(smooth_l1(pred, target_features), valid.astype(jnp.float32)))
            step_key = jax.random.fold_in(pos_key, s) if s else pos_key  # step 0: as before the unroll
            idx, weight = sample_positions(step_key, valid, self.num_positions)
            target_logits = target_lm(take(target_features, idx))
            logits = head.logits(take(pred, idx), target_lm)
            prob_losses.append(masked_mean(soft_ce(logits, jax.nn.softmax(target_logits, -1)), weight))
            agree = jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1)
            accs.append(masked_mean(agree.astype(jnp.float32), weight))
            features = pred
        value_loss, prob_loss = jnp.stack(value_losses), jnp.stack(prob_losses)
        decay = UNROLL_STEP_DECAY ** jnp.arange(self.depth)
        loss = (decay * (EAGLE_VALUE_WEIGHT * value_loss + EAGLE_PROB_WEIGHT * prob_loss)).sum()
        return loss, {"depth_loss": prob_loss, "depth_acc": jnp.stack(accs), "value_loss": value_loss[0]}

    def _eagle3(self, params, batch, key, target_lm, target_embed):
        head = nnx.merge(self.head_graphdef, params)
        tokens = batch["tokens"]
        b, n = tokens.shape[0], tokens.shape[1] - 1
        layer = self.head_config.layer
        draft_ids = head.target_ids()  # [Vd]
        tied = self.target_config.tie_word_embeddings
        rows = target_embed(draft_ids).astype(jnp.float32) if tied else None

        def target_draft_logits(h: jax.Array) -> jax.Array:
            """Target hidden [B, P, d] -> its logits over the draft vocabulary [B, P, Vd] (the LM head's
            draft rows only when tied), gradient stopped."""
            if tied:
                logits = jnp.einsum("bpd,vd->bpv", h.astype(jnp.float32), rows)
            else:
                logits = jnp.take(target_lm(h), draft_ids, axis=-1)
            return jax.lax.stop_gradient(logits)

        target_hidden = batch["hidden"][:, 1:]  # pair i's depth-1 target is the distribution at i + 1
        in_draft_vocab = head.t2d[...]  # [V] bool

        def position_mask(target_h: jax.Array, s: int, idx: jax.Array) -> jax.Array:
            """[B, P] 1.0 where the target's full-vocabulary argmax at the step-s targets is drafteable."""
            if "argmax" in batch:
                top = take(shifted(batch["argmax"][:, 1:], s, n), idx)
            else:
                top = jnp.argmax(jax.lax.stop_gradient(target_lm(target_h)), -1)
            return in_draft_vocab[top].astype(jnp.float32)

        hidden = head.project_target_features(batch["layers"][:, :n])
        keys, values = [], []
        losses, accs = [], []
        for s in range(self.depth):
            embeddings = head.embed(shifted(tokens, 1 + s, n), target_embed)
            positions = batch_positions(batch, n) + s
            inputs = unrolled_attention_inputs(b, layer, n, keys, values, hidden.dtype)
            out, k, v = head(embeddings, hidden, positions, inputs)
            keys.append(k)
            values.append(v)
            # The loss at num_positions of the valid pairs (all of them when num_positions >= n).
            idx, weight = sample_positions(
                jax.random.fold_in(key, s), label_mask(batch, 2 + s, n), self.num_positions
            )
            target_h = take(shifted(target_hidden, s, n), idx)  # [B, P, d]
            target_logits = target_draft_logits(target_h)  # [B, P, Vd]
            weight = weight * position_mask(target_h, s, idx)
            logits = head.draft_logits(take(out, idx))  # [B, P, Vd]
            loss = soft_ce(logits, jax.nn.softmax(target_logits, -1))  # [B, P]
            if self.argmax_weight > 0.0:
                argmax_ce, _ = hard_ce(logits, jnp.argmax(target_logits, -1))
                loss = (1.0 - self.argmax_weight) * loss + self.argmax_weight * argmax_ce
            losses.append(masked_mean(loss, weight))
            agree = jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1)
            accs.append(masked_mean(agree.astype(jnp.float32), weight))
            hidden = out
        depth_loss = jnp.stack(losses)
        decay = UNROLL_STEP_DECAY ** jnp.arange(self.depth)
        return (decay * depth_loss).sum(), {"depth_loss": depth_loss, "depth_acc": jnp.stack(accs)}

    def _mtp(self, params, batch, key, target_lm, target_embed):
        hidden, tokens = batch["hidden"], batch["tokens"]
        b, n = tokens.shape
        layer = self.head_config.layer
        inputs = empty_cache_inputs(b, layer.num_kv_heads, layer.head_dim, causal_visible(n), hidden.dtype)
        idx, weight = sample_positions(key, label_mask(batch, 2, n), self.num_positions)
        h = hidden
        losses, accs = [], []
        for s in range(self.depth):
            module = s % self.head_config.num_modules
            positions = batch_positions(batch, n) + s + 1
            embeddings = target_embed(shifted(tokens, s + 1, n))
            h, normed, _, _ = mtp_module_forward(
                self.head_graphdef, params, module, embeddings, h, positions, inputs
            )
            labels = take(shifted(tokens, s + 2, n), idx)
            ce, correct = self._mixed_ce(target_lm(take(normed, idx)), labels, hidden, idx, s + 2, target_lm)
            w = weight * take(label_mask(batch, s + 2, n), idx)
            losses.append(masked_mean(ce, w))
            accs.append(masked_mean(correct, w))
        depth_loss = jnp.stack(losses)
        metrics = {"depth_loss": depth_loss, "depth_acc": jnp.stack(accs)}
        if self.backbone_weight <= 0.0:
            return depth_loss.sum(), metrics
        main_idx, main_weight = sample_positions(
            jax.random.fold_in(key, 1), label_mask(batch, 1, n), self.num_positions
        )
        main_ce, _ = hard_ce(target_lm(take(hidden, main_idx)), take(shifted(tokens, 1, n), main_idx))
        main_loss = masked_mean(main_ce, main_weight)
        return main_loss + self.backbone_weight * depth_loss.sum(), dict(metrics, main_loss=main_loss)
