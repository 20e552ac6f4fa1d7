"""Tree builders: static (Medusa "choices") trees and dynamic (EAGLE-2) trees, both as `DraftTree`.

Static trees. A Medusa tree is a list of paths of top-k ranks, one rank per depth: (0,) is head 0's
best token, (1, 0) is head 0's second best followed by head 1's best. Medusa heads predict depth d
independently of the parent, so node (r_1, .., r_d) simply takes head d-1's rank-r_d token. A tree
comes from explicit choices, a named preset, or a head's own calibration (`calibrated_tree_choices`
over the rank accuracies that `jaxspec train` measures on held-out data, CALIBRATION_FILE).

Dynamic trees (EAGLE-2, as in the EAGLE repo's `topK_genrate` and SGLang's `select_top_k_tokens` /
`organize_draft_results`). The draft loop runs `num_steps` head forwards:
  step 0 expands the root into its top-k children (k candidates);
  step s >= 1 expands each of the k frontier nodes into its top-k children (k*k candidates), with
  cumulative score = parent score + draft log-prob; the k best of them form the next frontier.
All candidates go into one pool of M = k + (num_steps - 1) * k * k nodes, laid out step after step
(`candidate_pool_offset`), and the `num_draft_tokens` best by cumulative score become the tree.
The draft loop (running the head) lives with the drafter; this file gives it the pure pieces:
`root_frontier`, `expand_frontier`, `stack_candidates`, `select_dynamic_tree`.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.resources import configs_dir
from jaxspec.sampling.tree import DraftTree

TREE_PRESETS_PATH = configs_dir() / "medusa_trees.json"


# ---------------------------------------------------------------------------------------------------
# Static (Medusa) trees
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape from Medusa choices; hashable, so it can be a static `jax.jit` argument.

    choices: the paths, sorted by (depth, path); node i >= 1 is choices[i - 1].
    parent:  [N] parent node index, -1 for the root (node 0); parent[i] < i.
    depth:   [N] 0 for the root.
    rank:    [N] the node's rank in its head's top-k (0 for the root, unused).
    """

    choices: tuple[tuple[int, ...], ...]
    parent: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def max_depth(self) -> int:
        """Number of heads the tree needs."""
        return max(self.depth)

    @property
    def top_k(self) -> int:
        """Top-k each head must provide (largest rank + 1)."""
        return max(self.rank) + 1


def static_tree_from_choices(choices: Sequence[Sequence[int]]) -> StaticTree:
    """Validate Medusa choices and order them parents-before-children (by depth, then path).

    Raises ValueError naming the offending path when a path is empty, has a negative rank, is
    repeated, or lacks its parent path (every proper prefix of a path must itself be a path).
    """
    paths = [tuple(int(r) for r in path) for path in choices]
    if not paths:
        raise ValueError("tree choices: need at least one path")
    seen: set[tuple[int, ...]] = set()
    for path in paths:
        if not path:
            raise ValueError("tree choices: empty path () (the root is implicit)")
        if min(path) < 0:
            raise ValueError(f"tree choices: path {path} has a negative rank")
        if path in seen:
            raise ValueError(f"tree choices: path {path} appears twice")
        seen.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"tree choices: path {path} has no parent path {path[:-1]}")

    ordered = tuple(sorted(paths, key=lambda p: (len(p), p)))
    node_of = {path: i + 1 for i, path in enumerate(ordered)}
    parent = (-1,) + tuple(node_of[p[:-1]] if len(p) > 1 else 0 for p in ordered)
    depth = (0,) + tuple(len(p) for p in ordered)
    rank = (0,) + tuple(p[-1] for p in ordered)
    return StaticTree(choices=ordered, parent=parent, depth=depth, rank=rank)


def load_tree_preset(name: str, path: str | Path = TREE_PRESETS_PATH) -> StaticTree:
    """A named tree from configs/medusa_trees.json (e.g. "mc_sim_7b_63", "tree_16", "chain_4")."""
    presets = json.loads(Path(path).read_text())["presets"]
    if name not in presets:
        raise ValueError(f"{path}: unknown tree preset {name!r} (known: {sorted(presets)})")
    return static_tree_from_choices(presets[name]["choices"])


CALIBRATION_FILE = "tree_calibration.json"


@dataclasses.dataclass(frozen=True)
class TreeCalibration:
    """A Medusa head's rank statistics on held-out data (`jaxspec train` writes them at export).

    rank_accuracy: [D, R] float, row d = head d (the draft at depth d + 1), column r = the fraction of
      positions whose right token is that head's rank-r token.
    joint: [R + 1] * J float or None: the fraction of positions whose first J heads' right tokens sit at
      ranks (r_1, .., r_J) of those heads, index R standing for "rank R or worse". Heads are wrong
      together (a hard position defeats them all), so a path's acceptance is read from here rather
      than taken as the product of its heads' accuracies.
    """

    rank_accuracy: np.ndarray
    joint: np.ndarray | None = None


def _path_values(rank_accuracy: np.ndarray, joint: np.ndarray | None) -> tuple[np.ndarray, Any]:
    """(acc, value): acc the validated [D, R] table; value(path) the probability that a round
    accepts every draft of `path`: from `joint` up to its depth (marginalised over the rest), times the
    independent accuracies of the heads below it."""
    acc = np.asarray(rank_accuracy, np.float64)
    if acc.ndim != 2 or acc.shape[0] < 1 or acc.shape[1] < 1:
        raise ValueError(f"calibrated_tree_choices: rank_accuracy must be [heads, ranks], got {acc.shape}")
    if not np.all((acc >= 0) & (acc <= 1)):
        raise ValueError("calibrated_tree_choices: rank accuracies must lie in [0, 1]")
    if joint is None:
        return acc, lambda path: float(np.prod([acc[j, r] for j, r in enumerate(path)]))
    table = np.asarray(joint, np.float64)
    joint_heads = table.ndim
    if joint_heads < 1 or any(n != table.shape[0] for n in table.shape) or table.shape[0] <= acc.shape[1]:
        raise ValueError(
            f"calibrated_tree_choices: joint must be [R + 1] * J with R >= {acc.shape[1]} ranks, got "
            f"{table.shape}"
        )
    if not np.all(table >= 0) or table.sum() > 1 + 1e-6:
        raise ValueError("calibrated_tree_choices: joint rank frequencies must be >= 0 and sum to <= 1")

    def value(path: Sequence[int]) -> float:
        head = tuple(path[:joint_heads])
        prefix = float(table[head].sum())
        return prefix * float(np.prod([acc[j, r] for j, r in enumerate(path) if j >= joint_heads]))

    return acc, value


def calibrated_tree_choices(
    rank_accuracy: np.ndarray, num_paths: int, joint: np.ndarray | None = None
) -> tuple[tuple[int, ...], ...]:
    """The Medusa tree of `num_paths` drafts with the most expected accepted tokens (Medusa's own recipe
    for its trees, e.g. mc_sim_7b_63, with the heads' joint statistics where they are known).

    rank_accuracy, joint: as in `TreeCalibration` (ranks r < R of D heads are the candidate drafts).
    A path (r_1, .., r_d) is accepted when every head along it is right: its value is the joint
    frequency of those ranks (without `joint`: prod_j rank_accuracy[j - 1, r_j], Medusa's independence
    assumption), and the tree's expected accepted drafts are the sum of its paths' values. A child's
    value never exceeds its parent's (its event is contained in the parent's), so adding the best path
    whose parent is in the tree, `num_paths` times (best first), gives a tree of the largest sum (and
    parents before children, as `static_tree_from_choices` needs). Ties go to the shorter path, then
    the lower ranks. Returns the paths in the order they were taken.
    """
    acc, value = _path_values(rank_accuracy, joint)
    depth, ranks = acc.shape
    if not 1 <= num_paths <= sum(ranks**d for d in range(1, depth + 1)):
        raise ValueError(f"calibrated_tree_choices: {num_paths} paths do not fit {depth} heads x top-{ranks}")
    frontier = [(-value((r,)), 1, (r,)) for r in range(ranks)]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < num_paths:
        _, length, path = heapq.heappop(frontier)
        chosen.append(path)
        if length < depth:
            for r in range(ranks):
                child = path + (r,)
                heapq.heappush(frontier, (-value(child), length + 1, child))
    return tuple(chosen)


def expected_accepted_drafts(
    choices: Sequence[Sequence[int]], rank_accuracy: np.ndarray, joint: np.ndarray | None = None
) -> float:
    """Sum over paths of their values (`calibrated_tree_choices`): the drafts a round accepts on
    average (τ = 1 + this)."""
    _, value = _path_values(rank_accuracy, joint)
    return float(sum(value(path) for path in choices))


def save_tree_calibration(
    directory: str | Path, rank_accuracy: np.ndarray, joint: np.ndarray | None = None, **info: Any
) -> Path:
    """Write a head's rank statistics (`TreeCalibration`) to directory/CALIBRATION_FILE, with `info`
    (where they were measured) beside them."""
    record: dict[str, Any] = {"rank_accuracy": np.asarray(rank_accuracy, np.float64).round(6).tolist()}
    if joint is not None:
        record["joint"] = np.asarray(joint, np.float64).round(7).tolist()
    path = Path(directory) / CALIBRATION_FILE
    # One key per line, each value compact: the joint table holds (R + 1) ** J numbers.
    fields = ",\n".join(
        f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in {**record, **info}.items()
    )
    path.write_text("{\n" + fields + "\n}\n")
    return path


def load_tree_calibration(directory: str | Path) -> TreeCalibration | None:
    """A head directory's rank statistics (None when it has no CALIBRATION_FILE).

    Raises ValueError naming the file when rank_accuracy is not a [heads, ranks] table of numbers in
    [0, 1], or joint is not a [R + 1] * J table of frequencies."""
    path = Path(directory) / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        acc = np.asarray(record["rank_accuracy"], np.float64)
        joint = np.asarray(record["joint"], np.float64) if "joint" in record else None
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a tree calibration ({error})") from None
    if acc.ndim != 2 or acc.size == 0 or not np.all((acc >= 0) & (acc <= 1)):
        raise ValueError(f"{path}: rank_accuracy must be a [heads, ranks] table of numbers in [0, 1]")
    try:
        _path_values(acc, joint)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return TreeCalibration(acc, joint)


@functools.partial(jax.jit, static_argnames=("static",))
def fill_static_tree(static: StaticTree, root: jax.Array, topk_tokens: jax.Array) -> DraftTree:
    """Put each head's top-k tokens into the static tree.

    root:        [B] int32 the pending token.
    topk_tokens: [B, D, K] int32, head d's top-K tokens (D >= static.max_depth, K >= static.top_k).
    Returns a DraftTree with N = static.num_nodes nodes, all valid; node (r_1..r_d) takes
    topk_tokens[:, d - 1, r_d]; q_probs None.
    """
    batch, num_heads, k = topk_tokens.shape
    if num_heads < static.max_depth or k < static.top_k:
        raise ValueError(
            f"fill_static_tree: tree needs {static.max_depth} heads x top-{static.top_k}, "
            f"got topk_tokens of shape {topk_tokens.shape}"
        )
    head = np.asarray(static.depth[1:]) - 1
    rank = np.asarray(static.rank[1:])
    drafts = topk_tokens[:, head, rank]  # [B, N - 1]
    n = static.num_nodes
    return DraftTree(
        tokens=jnp.concatenate([root[:, None], drafts], axis=1).astype(jnp.int32),
        parent=jnp.broadcast_to(jnp.asarray(static.parent, jnp.int32), (batch, n)),
        depth=jnp.broadcast_to(jnp.asarray(static.depth, jnp.int32), (batch, n)),
        valid=jnp.ones((batch, n), dtype=bool),
        q_probs=None,
    )


# ---------------------------------------------------------------------------------------------------
# Dynamic (EAGLE-2) trees
# ---------------------------------------------------------------------------------------------------


def candidate_pool_size(topk: int, num_steps: int) -> int:
    """M: candidates pooled by `num_steps` draft steps of top-`topk` expansion."""
    return topk + (num_steps - 1) * topk * topk


def candidate_pool_offset(step: int | jax.Array, topk: int) -> int | jax.Array:
    """Pool index of the first candidate made at `step` (step 0: k candidates, later steps: k*k)."""
    if isinstance(step, int | np.integer):
        return 0 if step == 0 else topk + (int(step) - 1) * topk * topk
    return jnp.where(step == 0, 0, topk + (step - 1) * topk * topk)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FrontierExpansion:
    """One draft step's output (C = F * topk candidates made from F frontier nodes).

    cand_tokens: [B, C] int32   candidate j is child j % topk (by rank) of frontier node j // topk.
    cand_parent: [B, C] int32   pool index of the candidate's parent, -1 for the root.
    cand_score:  [B, C] float32 cumulative draft log-prob of the path root -> candidate.
    next_tokens: [B, topk] int32     the next frontier: best `topk` candidates, best first.
    next_score:  [B, topk] float32
    next_pool_index: [B, topk] int32 their pool indices (parents of the next step's candidates).
    next_source: [B, topk] int32     which input frontier slot (0..F-1) each one descends from: gather
                 the head's hidden states / tree mask rows with it.
    """

    cand_tokens: jax.Array
    cand_parent: jax.Array
    cand_score: jax.Array
    next_tokens: jax.Array
    next_score: jax.Array
    next_pool_index: jax.Array
    next_source: jax.Array


def root_frontier(batch: int) -> tuple[jax.Array, jax.Array]:
    """The step-0 frontier, the root alone: scores [B, 1] = 0 and pool indices [B, 1] = -1."""
    return jnp.zeros((batch, 1), jnp.float32), jnp.full((batch, 1), -1, jnp.int32)


@functools.partial(jax.jit, static_argnames=("topk",))
def expand_frontier(
    frontier_score: jax.Array,
    frontier_pool_index: jax.Array,
    logprobs: jax.Array,
    *,
    topk: int,
    step: int | jax.Array,
) -> FrontierExpansion:
    """Expand every frontier node by its top-`topk` draft tokens and keep the best `topk` as frontier.

    frontier_score:      [B, F] cumulative log-probs of the frontier nodes (F = 1 at step 0, else topk).
    frontier_pool_index: [B, F] their pool indices (-1 for the root).
    logprobs:            [B, F, V] draft log-probs at each frontier node.
    step: this step's number (0 = root expansion); places the candidates at candidate_pool_offset.
    """
    batch, width, _ = logprobs.shape
    child_logp, child_tokens = jax.lax.top_k(logprobs, topk)  # [B, F, k]
    cand_score = (frontier_score[:, :, None] + child_logp).reshape(batch, width * topk)
    cand_tokens = child_tokens.reshape(batch, width * topk).astype(jnp.int32)
    cand_parent = jnp.repeat(frontier_pool_index.astype(jnp.int32), topk, axis=1)
    next_score, next_index = jax.lax.top_k(cand_score, topk)  # ties: lower index first
    next_index = next_index.astype(jnp.int32)
    return FrontierExpansion(
        cand_tokens=cand_tokens,
        cand_parent=cand_parent,
        cand_score=cand_score.astype(jnp.float32),
        next_tokens=jnp.take_along_axis(cand_tokens, next_index, axis=1),
        next_score=next_score.astype(jnp.float32),
        next_pool_index=(candidate_pool_offset(step, topk) + next_index).astype(jnp.int32),
        next_source=next_index // topk,
    )


def stack_candidates(
    first: FrontierExpansion, later: FrontierExpansion | Sequence[FrontierExpansion] | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pool all candidates in step order: (tokens, parent, score), each [B, M].

    first: step 0's expansion. later: steps 1.. either as a list (an unrolled loop) or as one
    FrontierExpansion whose arrays carry a leading step axis [S - 1, B, k*k] (the output of lax.scan).
    """
    parts = [(first.cand_tokens, first.cand_parent, first.cand_score)]
    if later is not None:
        if not isinstance(later, FrontierExpansion):
            later = jax.tree.map(lambda *xs: jnp.stack(xs), *later)
        steps, batch, width = later.cand_tokens.shape

        def flat(x: jax.Array) -> jax.Array:
            return jnp.swapaxes(x, 0, 1).reshape(batch, steps * width)

        parts.append((flat(later.cand_tokens), flat(later.cand_parent), flat(later.cand_score)))
    tokens, parent, score = (jnp.concatenate(xs, axis=1) for xs in zip(*parts, strict=True))
    return tokens, parent, score


def _path_min_and_depth(
    cand_parent: jax.Array, score: jax.Array, alive: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per candidate: min score over its path, its depth, and whether its whole path is alive.

    cand_parent [B, M] (-1 = root, else < own index), score [B, M] float, alive [B, M] bool. Pointer
    jumping: ceil(log2(M + 1)) rounds of gathers, each doubling how far every node has looked up.
    """
    batch, m = cand_parent.shape
    sentinel = jnp.full((batch, 1), m, jnp.int32)  # index m stands for the root
    jump = jnp.concatenate([jnp.where(cand_parent < 0, m, cand_parent).astype(jnp.int32), sentinel], axis=1)
    path_min = jnp.concatenate([score, jnp.full((batch, 1), jnp.inf, score.dtype)], axis=1)
    depth = jnp.concatenate([jnp.ones((batch, m), jnp.int32), jnp.zeros((batch, 1), jnp.int32)], axis=1)
    path_alive = jnp.concatenate([alive, jnp.ones((batch, 1), bool)], axis=1)
    for _ in range(max(1, math.ceil(math.log2(m + 1)))):
        path_min = jnp.minimum(path_min, jnp.take_along_axis(path_min, jump, axis=1))
        depth = depth + jnp.take_along_axis(depth, jump, axis=1)
        path_alive = path_alive & jnp.take_along_axis(path_alive, jump, axis=1)
        jump = jnp.take_along_axis(jump, jump, axis=1)
    return path_min[:, :m], depth[:, :m], path_alive[:, :m]


@functools.partial(jax.jit, static_argnames=("num_draft_tokens",))
def select_dynamic_tree(
    root: jax.Array,
    cand_tokens: jax.Array,
    cand_parent: jax.Array,
    cand_score: jax.Array,
    num_draft_tokens: int,
    cand_valid: jax.Array | None = None,
) -> DraftTree:
    """EAGLE-2 tree: the `num_draft_tokens` best candidates by cumulative score, plus the root.

    root:        [B] int32 the pending token.
    cand_tokens: [B, M] int32 pooled candidates (see `stack_candidates`).
    cand_parent: [B, M] int32 pool index of each candidate's parent (-1 = root); must be < own index.
    cand_score:  [B, M] float cumulative draft log-prob (or any score; see below).
    cand_valid:  [B, M] bool or None (all valid); invalid candidates rank last and stay invalid.
    Returns a DraftTree with N = 1 + num_draft_tokens nodes in pool order (so parents come first),
    q_probs None.

    A node ranks by the minimum score along its path (equal to its own score for log-prob sums, which
    never increase along a path), ties broken by lower pool index. A parent therefore always ranks
    ahead of its children, so the selection always contains every selected node's ancestors.
    """
    batch, m = cand_tokens.shape
    if not 1 <= num_draft_tokens <= m:
        raise ValueError(f"select_dynamic_tree: num_draft_tokens must be in [1, {m}], got {num_draft_tokens}")
    alive = jnp.ones((batch, m), bool) if cand_valid is None else cand_valid.astype(bool)
    score = jnp.where(alive, cand_score.astype(jnp.float32), -jnp.inf)
    path_score, depth, path_alive = _path_min_and_depth(cand_parent, score, alive)

    _, picked = jax.lax.top_k(path_score, num_draft_tokens)  # ties: lower index first
    picked = jnp.sort(picked, axis=1).astype(jnp.int32)  # pool order: parents before children
    node_of = (
        jnp.zeros((batch, m), jnp.int32)
        .at[jnp.arange(batch)[:, None], picked]
        .set(jnp.arange(1, num_draft_tokens + 1, dtype=jnp.int32))
    )
    pool_parent = jnp.take_along_axis(cand_parent, picked, axis=1)
    parent = jnp.where(pool_parent < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(pool_parent, 0), axis=1))

    def with_root(root_value: jax.Array, nodes: jax.Array) -> jax.Array:
        return jnp.concatenate([root_value, nodes], axis=1)

    return DraftTree(
        tokens=with_root(root[:, None].astype(jnp.int32), jnp.take_along_axis(cand_tokens, picked, axis=1)),
        parent=with_root(jnp.full((batch, 1), -1, jnp.int32), parent.astype(jnp.int32)),
        depth=with_root(jnp.zeros((batch, 1), jnp.int32), jnp.take_along_axis(depth, picked, axis=1)),
        valid=with_root(jnp.ones((batch, 1), bool), jnp.take_along_axis(path_alive, picked, axis=1)),
        q_probs=None,
    )
