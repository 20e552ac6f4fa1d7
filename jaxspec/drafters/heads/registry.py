"""`make_head_drafter(model, spec)`: the drafter (static) and its head parameters (traced) for
SpecConfig(method="medusa" | "eagle" | "eagle3" | "mtp").

spec.head: a checkpoint directory (jaxspec's own Orbax format or a published layout, see
`jaxspec.drafters.heads.loaders`); None for the head shipped with jaxspec for this model (an error when
there is none: `jaxspec.drafters.heads.shipped.resolve_head`), or for "mtp" on a DeepSeek-V3 target with
num_nextn_predict_layers >= 1, the MTP layers of the target's own checkpoint; "random" for a seeded
random head (correctness tests, cost measurements; quality needs a trained head). Shapes of the draft:
  chain (topk == 1): num_speculative_tokens sampled drafts with their q recorded (exact verification);
  Medusa static tree: spec.tree_choices, extra "tree_preset" (configs/medusa_trees.json), or topk > 1
    alone: the tree calibrated to the head (its directory's tree_calibration.json, `medusa_tree`);
  EAGLE / EAGLE-3 / MTP dynamic tree (topk > 1): depth = num_speculative_tokens, num_draft_tokens nodes
  (default min(topk * depth, pool size)).

Optional SpecConfig.extra keys: "seed" (random heads, default 0), "medusa_num_heads",
"medusa_num_layers" (1), "medusa_own_lm_head" (False: share the target's), "draft_vocab_size"
(EAGLE-3, default min(V, 32000)), "eagle3_layers" (default `default_eagle3_layers`), "eagle3_num_layers"
(the EAGLE-3 head's decoder layers, 1), "mtp_num_modules" (1),
"tree_preset".

Draft parameters: {"head": head parameters, "hook": hook parameters or ()}; a logits hook (see
`jaxspec.drafters.heads.drafting`) is passed to `make_head_drafter` directly.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from flax import nnx

from jaxspec.config import SpecConfig
from jaxspec.drafters.heads.configs import (
    Eagle3Config,
    EagleConfig,
    HeadConfig,
    MedusaConfig,
    MtpConfig,
    default_eagle3_layers,
    head_layer_config,
)
from jaxspec.drafters.heads.drafting import read_token_map, token_map_params
from jaxspec.drafters.heads.eagle.drafter import EagleDrafter
from jaxspec.drafters.heads.head import DraftHead, init_head
from jaxspec.drafters.heads.loaders import load_head
from jaxspec.drafters.heads.medusa.drafter import MedusaDrafter
from jaxspec.drafters.heads.mtp.drafter import MtpDrafter
from jaxspec.drafters.heads.shipped import RANDOM_HEAD, resolve_head, resolve_token_map
from jaxspec.drafters.tree_build import (
    CALIBRATION_FILE,
    StaticTree,
    TreeCalibration,
    calibrated_tree_choices,
    candidate_pool_size,
    load_tree_calibration,
    load_tree_preset,
    static_tree_from_choices,
)
from jaxspec.errors import InputError
from jaxspec.model.deepseek_v3.config import DeepseekV3Config


def _extra(spec: SpecConfig) -> dict[str, Any]:
    return dict(spec.extra)


def medusa_tree(spec: SpecConfig, calibration: TreeCalibration | None = None) -> StaticTree | None:
    """The static tree of a Medusa spec, or None for a chain.

    calibration: the head's rank statistics (`load_tree_calibration`), or None. With
    neither tree_choices nor a preset, topk > 1 drafts the calibrated tree (`calibrated_tree_choices`)
    of num_draft_tokens paths (default topk * depth) over ranks < topk and depths <= min(depth, heads).
    """
    preset = _extra(spec).get("tree_preset")
    if spec.tree_choices is not None and preset is not None:
        raise InputError("SpecConfig: give tree_choices or extra 'tree_preset', not both")
    if spec.tree_choices is not None:
        return static_tree_from_choices(spec.tree_choices)
    if preset is not None:
        return load_tree_preset(preset)
    if spec.topk > 1:
        if calibration is None:
            raise InputError(
                "medusa drafts trees from SpecConfig.tree_choices, extra 'tree_preset' or the head's "
                f"{CALIBRATION_FILE} (written by `jaxspec train`); this head has none and topk > 1 alone "
                "is not a tree"
            )
        acc = calibration.rank_accuracy[: spec.num_speculative_tokens, : spec.topk]
        size = spec.num_draft_tokens or spec.topk * spec.num_speculative_tokens
        try:
            return static_tree_from_choices(calibrated_tree_choices(acc, size, calibration.joint))
        except ValueError as error:
            raise InputError(f"SpecConfig.num_draft_tokens={size}: {error}") from None
    return None


def random_head_config(model, spec: SpecConfig) -> HeadConfig:
    """The config of a random head for `model` (spec.head == "random")."""
    target = model.config
    extra = _extra(spec)
    layer = head_layer_config(target)
    if spec.method == "medusa":
        tree = medusa_tree(spec)
        depth = tree.max_depth if tree is not None else spec.num_speculative_tokens
        return MedusaConfig(
            num_heads=int(extra.get("medusa_num_heads", depth)),
            num_layers=int(extra.get("medusa_num_layers", 1)),
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            own_lm_head=bool(extra.get("medusa_own_lm_head", False)),
        )
    if spec.method == "eagle":
        return EagleConfig(layer=layer)
    if spec.method == "eagle3":
        layers = extra.get("eagle3_layers") or default_eagle3_layers(target.num_layers)
        return Eagle3Config(
            layer=layer.replace(num_layers=int(extra.get("eagle3_num_layers", 1))),
            target_hidden_size=target.hidden_size,
            draft_vocab_size=int(extra.get("draft_vocab_size", min(target.vocab_size, 32000))),
            target_layers=tuple(int(i) for i in layers),
        )
    if spec.method == "mtp":
        return MtpConfig(layer=layer, num_modules=int(extra.get("mtp_num_modules", 1)))
    raise InputError(f"make_head_drafter: {spec.method!r} is not a head method")


def head_path(model, spec: SpecConfig) -> str | None:
    """The directory spec's head loads from (None for a random head)."""
    if spec.head == RANDOM_HEAD:
        return None
    path = spec.head
    if path is None and spec.method == "mtp" and isinstance(model.config, DeepseekV3Config):
        if model.config.num_nextn_predict_layers:  # DeepSeek-V3: the MTP layers of its own checkpoint
            path = model.source
    return path if path is not None else resolve_head(model.source, spec.method, None)


@functools.lru_cache(maxsize=8)
def _head_for(model, spec: SpecConfig) -> DraftHead:
    path = head_path(model, spec)
    if path is None:
        return init_head(random_head_config(model, spec), model.dtype, int(_extra(spec).get("seed", 0)))
    return load_head(path, spec.method, model.config, model.dtype, _extra(spec))


def head_for(model, spec: SpecConfig) -> DraftHead:
    """The (cached) head of `spec` for `model`: loaded from spec.head (None: the shipped head) or
    randomly initialised (spec.head == "random")."""
    return _head_for(model, spec)


def check_head_fits(head: DraftHead, model) -> None:
    target = model.config
    config = head.config
    width = config.hidden_size if isinstance(config, MedusaConfig) else config.layer.hidden_size
    needs_target_width = not (isinstance(config, Eagle3Config) and config.own_embedding)
    if needs_target_width and width != target.hidden_size:
        raise InputError(f"draft head {head.source}: hidden size {width} != target's {target.hidden_size}")
    if isinstance(config, Eagle3Config):
        if config.target_hidden_size != target.hidden_size:
            raise InputError(
                f"draft head {head.source}: fuses target features of width {config.target_hidden_size}, "
                f"target has {target.hidden_size}"
            )
        bad = [i for i in config.target_layers if not 0 <= i < target.num_layers]
        if bad:
            raise InputError(
                f"draft head {head.source}: target layers {bad} outside [0, {target.num_layers})"
            )


def num_draft_tokens_for(spec: SpecConfig) -> int:
    """Dynamic tree size (topk > 1)."""
    pool = candidate_pool_size(spec.topk, spec.num_speculative_tokens)
    size = spec.num_draft_tokens or min(spec.topk * spec.num_speculative_tokens, pool)
    if not 1 <= size <= pool:
        raise InputError(
            f"SpecConfig.num_draft_tokens={size}: a tree of topk={spec.topk}, "
            f"depth={spec.num_speculative_tokens} has {pool} candidates"
        )
    return size


def make_head_drafter(model, spec: SpecConfig, *, logits_hook: Any = None, hook_params: Any = ()):
    """(drafter, draft_params) for a head method; see the module docstring.

    logits_hook: static hook applied to every draft logits array (`jaxspec.drafters.heads.drafting`), with
    its data `hook_params` in draft_params["hook"].
    """
    hook = logits_hook
    hook_data = hook_params if hook is not None else ()
    head = head_for(model, spec)
    check_head_fits(head, model)
    config = head.config
    depth = spec.num_speculative_tokens
    token_map, token_data = spec.token_map is not None, ()
    if token_map:
        if hook is not None:
            raise InputError("SpecConfig.token_map: a logits hook rewrites whole-vocabulary logits; drop one")
        path = resolve_token_map(model.source, spec.token_map)
        ids = read_token_map(path, model.config.vocab_size)
        token_data = token_map_params(ids, nnx.merge(model.graphdef, model.params).lm_head_rows())
    if isinstance(config, MedusaConfig):
        path = head_path(model, spec)
        try:
            calibration = load_tree_calibration(path) if path is not None and Path(path).is_dir() else None
        except ValueError as error:
            raise InputError(str(error)) from None
        tree = medusa_tree(spec, calibration)
        needed = tree.max_depth if tree is not None else depth
        if needed > config.num_heads:
            raise InputError(
                f"draft head {head.source}: {config.num_heads} Medusa heads, the draft needs {needed}"
            )
        drafter = MedusaDrafter(
            target_graphdef=model.graphdef,
            head_graphdef=head.graphdef,
            config=config,
            depth=depth,
            static_tree=tree,
            logits_hook=hook,
        )
        return drafter, {"head": head.params, "hook": hook_data}
    tree_size = num_draft_tokens_for(spec) if spec.topk > 1 else None
    if isinstance(config, EagleConfig | Eagle3Config):
        layers = config.target_layers if isinstance(config, Eagle3Config) else ()
        drafter = EagleDrafter(
            target_graphdef=model.graphdef,
            head_graphdef=head.graphdef,
            config=config,
            depth=depth,
            topk=spec.topk,
            num_draft_tokens=tree_size,
            logits_hook=hook,
            capture_layers=layers,
            token_map=token_map,
        )
        return drafter, {"head": head.params, "hook": hook_data, "token_map": token_data}
    drafter = MtpDrafter(
        target_graphdef=model.graphdef,
        module_graphdef=head.graphdef,
        config=config,
        depth=depth,
        topk=spec.topk,
        num_draft_tokens=tree_size,
        logits_hook=hook,
        token_map=token_map,
    )
    return drafter, {"head": head.params, "hook": hook_data, "token_map": token_data}
