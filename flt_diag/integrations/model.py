"""What the probe (flt_diag.integrations.watch) reads off a model it did not build: the blocks it reuses
(given as modules, as a module-path pattern, or found), the parameter groups of the diagnostics, and the
shape figures stored in the run folder's config.json.

Parameter groups, in the order of flt-diag's own model (flt_diag.model.transformer.parameter_groups):
  embedding      the parameters of every nn.Embedding outside the blocks
  head           the parameters of `head`; default: the module producing the logits - the last nn.Linear outside
                 the blocks whose outputs are the vocabulary (out_features = an nn.Embedding's num_embeddings),
                 at any depth; else the last module named `lm_head` or `head`, at any depth
  block<i>.attn  block i's attention modules, found by structure: every nn.MultiheadAttention, and every module
                 whose children compute the queries, keys and values (children q/k/v, q_proj/k_proj/v_proj,
                 query/key/value, or a fused qkv / c_attn / Wqkv / query_key_value / in_proj); in a flat block
                 (the block's own children are those, beside its MLP) only those children and its output
                 projection (o / wo / o_proj / out_proj / proj); only in a block with none of these, the
                 parameters whose path names attention (`attn` or `attention`)
  block<i>.mlp   the rest of block i (its MLP, and its norms)
  other          every other trainable parameter
A parameter shared by two places (tied embedding and head) counts once, in the first group. Empty
groups are left out.
"""
from __future__ import annotations

import fnmatch
import sys

import torch
import torch.nn as nn

from flt_diag.instruments.loop_hooks import BlockCalledTwice, BlocksNotFound, ProbeError

HEAD_COUNTS = ("num_heads", "n_head", "num_attention_heads", "nhead", "n_heads")
QKV = ({"q", "k", "v"}, {"q_proj", "k_proj", "v_proj"}, {"query", "key", "value"}, {"wq", "wk", "wv"})
FUSED_QKV = {"qkv", "c_attn", "wqkv", "query_key_value", "in_proj", "qkv_proj"}
OUT_PROJ = {"o", "wo", "o_proj", "out_proj", "proj", "attn_proj", "c_proj_attn", "attn_out"}  # (a flat block's)
ATTENTION_CHILDREN = set().union(*QKV, FUSED_QKV, OUT_PROJ)


def _matches(pattern: str, name: str) -> bool:
    """A module path against a pattern, segment by segment ("transformer.h.*" matches transformer.h.0,
    not transformer.h.0.attn)."""
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want))


def auto_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The largest ModuleList whose modules are all of one class (a stack of blocks); a module listed twice
    (a repeated layer list) counts once, at its first place."""
    best: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len({type(c) for c in m}) == 1:
            firsts = {id(c): (f"{name}.{i}" if name else str(i), c) for i, c in reversed(list(enumerate(m)))}
            found = sorted(firsts.values(), key=lambda nm: [id(c) for c in m].index(id(nm[1])))
            if len(found) > len(best):
                best = found
    if not best:
        raise BlocksNotFound(f"blocks='auto' found no list of blocks (an nn.ModuleList of one module class) in "
                             f"{type(model).__name__}; give blocks= (modules or a module-path pattern)")
    return best


def called_blocks(model: nn.Module, args: tuple, kwargs: dict) -> tuple[list[tuple[str, nn.Module]], int]:
    """blocks="auto": (the blocks, the loops) that one forward of `model` on (args, kwargs) actually reuses - the
    outermost submodules with parameters called more than once, in the order of their first call (a prelude
    or coda run once is left out; a layer list that repeats its layers gives each layer once), less those whose
    output is not the stream they are given (stream_blocks), refused if they run as separate loops (one_loop). The
    forward runs without gradient, its random draws undone (the training forward after it draws the same)."""
    calls: dict[int, int] = {}
    sequence: list[int] = []  # every call, in order
    shapes: dict[int, list] = {}  # its first call's [input stream's shape, output's shape]
    named = [(n, m) for n, m in model.named_modules() if n and next(m.parameters(), None) is not None]

    def count(m, a, kw):
        calls[id(m)] = calls.get(id(m), 0) + 1
        sequence.append(id(m))
        shapes.setdefault(id(m), [first_shape([*a, *kw.values()]), "unset"])

    def returned(m, a, kw, out):
        if shapes[id(m)][1] == "unset":
            shapes[id(m)][1] = first_shape([out[0] if isinstance(out, (tuple, list)) and out else out])
    handles = [h for _, m in named for h in (m.register_forward_pre_hook(count, with_kwargs=True),
                                             m.register_forward_hook(returned, with_kwargs=True))]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    repeated = [(n, m) for n, m in named if calls.get(id(m), 0) >= 2]
    names = [n for n, _ in repeated]
    outer = [(n, m) for n, m in repeated if not any(n.startswith(o + ".") for o in names)]
    outer.sort(key=lambda nm: sequence.index(id(nm[1])))
    outer = stream_blocks(outer, shapes)
    one_loop(outer, sequence, calls)
    return outer, max((calls[id(m)] for _, m in outer), default=1)


def first_shape(values: list) -> tuple[int, ...] | None:
    """The shape of the first tensor in `values`, or None."""
    return next((tuple(v.shape) for v in values if torch.is_tensor(v)), None)


def stream_blocks(found: list[tuple[str, nn.Module]], shapes: dict[int, list]) -> list[tuple[str, nn.Module]]:
    """blocks="auto": the reused modules whose output has the loop's stream's shape - a shape the reused modules
    both take (their first tensor argument) and return (a block of the loop maps the stream on). The others (a
    halting unit nn.Linear(d, 1) read off the stream, a gate) are left out, said on stderr; none left is refused:
    their records would read as a collapse that is not there. Not judged where none takes a tensor."""
    given, out = ({shapes[id(m)][k] for _, m in found} - {None, "unset"} for k in (0, 1))
    if not given:
        return found
    stream = given & out
    kept = [(n, m) for n, m in found if shapes[id(m)][1] in stream]
    left = [f"{n} ({shapes[id(m)][0]} -> {shapes[id(m)][1] or 'no tensor'})" for n, m in found if (n, m) not in kept]
    if not kept:
        raise BlocksNotFound(f"blocks='auto': no module the forward reuses returns a stream of a shape they take "
                             f"({', '.join(left)}): none is a block of the loop; give blocks= the loop's blocks")
    if left:
        print(f"flt_diag.watch: blocks='auto' left out {', '.join(left)}: not of the stream's shape "
              f"({' or '.join(map(str, sorted(stream)))}), so not a block of the loop (a halting unit, a gate?); give "
              "blocks= to choose", file=sys.stderr, flush=True)
    return kept


def as_code(path: str) -> str:
    """A module path as the expression that reaches it: 'enc.layers.0' -> 'model.enc.layers[0]'."""
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))


def one_loop(found: list[tuple[str, nn.Module]], sequence: list[int], calls: dict[int, int]) -> None:
    """blocks="auto": the chosen blocks run as one loop - refused (one line saying what to give) if they form
    separate loops, one after the other (a block first called after every call of the blocks before it)."""
    ids = [i for i in sequence if i in {id(m) for _, m in found}]
    loops: list[list[tuple[str, nn.Module]]] = []
    end = -1
    for n, m in found:  # (in the order of their first call)
        if not loops or ids.index(id(m)) > end:
            loops.append([])
        loops[-1].append((n, m))
        end = max(end, len(ids) - 1 - ids[::-1].index(id(m)))
    if len(loops) > 1:
        runs = ", then ".join(f"{', '.join(n for n, _ in loop)} {calls[id(loop[0][1])]} times" for loop in loops)
        options = " or ".join(f"blocks=[{', '.join(as_code(n) for n, _ in loop)}]" for loop in loops)
        raise BlockCalledTwice(f"blocks='auto': the forward runs {len(loops)} separate loops ({runs}); the probe "
                               f"records one: give blocks= the blocks of the one to record: {options}")


def resolve_blocks(model: nn.Module, blocks) -> tuple[list[nn.Module], list[str]]:
    """(blocks, their module paths) from a module-path pattern, a module list or one module (blocks="auto": found
    at the first training forward, called_blocks)."""
    named = list(model.named_modules())
    if isinstance(blocks, str):
        found = [(n, m) for n, m in named if n and _matches(blocks, n)]
        if not found:
            raise BlocksNotFound(f"no module of {type(model).__name__} matches blocks={blocks!r} (module paths look "
                                 f"like {', '.join(n for n, _ in named[1:4]) or 'none: the model has no submodule'})")
    else:
        given = list(blocks) if isinstance(blocks, (list, tuple, nn.ModuleList, nn.Sequential)) else [blocks]
        if not given:
            raise BlocksNotFound("the block list is empty; give the blocks the model's forward reuses")
        path = {id(m): n for n, m in named}
        for i, b in enumerate(given):
            if not isinstance(b, nn.Module) or id(b) not in path:
                raise BlocksNotFound(f"block {i + 1} of blocks= ({type(b).__name__}) is not a submodule of "
                                     f"{type(model).__name__}")
        found = [(path[id(b)] or type(b).__name__, b) for b in given]
    if len({id(m) for _, m in found}) < len(found):
        raise ProbeError("blocks= names the same module twice; give each block once")
    return [m for _, m in found], [n for n, _ in found]


def check_untied(model: nn.Module, blocks: list[nn.Module], names: list[str]) -> None:
    """Refuses blocks that share parameters (weights tied across two module objects): their per-block records
    would be partial (a shared parameter counts once, in the first block's group). Refuses a block whose weights a
    module outside the blocks holds too (ALBERT-style copies of one layer, a module object each loop, their weights
    tied): the hooks see module objects, so the block's records would be of the loops that call it only - loop 1 of
    a loop_boundary= count, silently."""
    owner: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            j = owner.setdefault(id(p), i)
            if j != i:
                raise ProbeError(f"blocks {names[j]} and {names[i]} share parameters (weights tied across two "
                                 "modules): give each shared block once - the module the forward reuses - or untie them")
    inside = {id(m) for b in blocks for m in b.modules()}
    for path, m in model.named_modules():
        tied = [owner[id(p)] for p in m.parameters(recurse=False) if id(p) in owner] if id(m) not in inside else []
        if tied:
            raise ProbeError(f"block {names[tied[0]]} shares its weights with {path}, a module outside the blocks "
                             "(copies of one layer tied ALBERT-style, a module object each loop?): the hooks see "
                             "module objects, so only the loops that call the block itself would be recorded; run "
                             "every loop through one module object")


def default_head(model: nn.Module, blocks: list[nn.Module]) -> nn.Module | None:
    """The module producing the logits (module docstring), outside the blocks; None if none is found."""
    inside = {id(m) for b in blocks for m in b.modules()}
    outside = [(n, m) for n, m in model.named_modules() if id(m) not in inside]
    vocab = {m.num_embeddings for _, m in outside if isinstance(m, nn.Embedding)}
    found = [m for _, m in outside if isinstance(m, nn.Linear) and m.out_features in vocab]
    found = found or [m for n, m in outside if n.rpartition(".")[2] in ("lm_head", "head")]
    return found[-1] if found else None


def attention_modules(block: nn.Module) -> list[nn.Module]:
    """The block's attention modules, by structure (module docstring). In a flat block (the block's own children
    compute the queries, keys and values, beside its MLP) those children and its output projection only."""
    found = []
    for m in block.modules():
        children = {n.lower(): c for n, c in m.named_children()}
        if isinstance(m, nn.MultiheadAttention) or any(q <= children.keys() for q in QKV) or children.keys() & FUSED_QKV:
            if m is block and not isinstance(m, nn.MultiheadAttention):
                found += [c for n, c in children.items() if n in ATTENTION_CHILDREN]
            else:
                found.append(m)
    return found


def parameter_groups_of(model: nn.Module, blocks: list[nn.Module], head: nn.Module | None) -> dict[str, list]:
    """The diagnostics' parameter groups of any looped model (module docstring)."""
    seen: set[int] = set()

    def take(params) -> list:
        out = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    inside = {id(p) for b in blocks for p in b.parameters()}
    groups = {"embedding": take(p for m in model.modules() if isinstance(m, nn.Embedding)
                                for p in m.parameters(recurse=False) if id(p) not in inside),
              "head": take(head.parameters()) if head is not None else []}
    for i, block in enumerate(blocks):
        attn = {id(p) for m in attention_modules(block) for p in m.parameters()}
        named = list(block.named_parameters())
        is_attn = [id(p) in attn if attn else any(w in n.lower() for w in ("attn", "attention")) for n, p in named]
        groups[f"block{i}.attn"] = take(p for (_, p), a in zip(named, is_attn) if a)
        groups[f"block{i}.mlp"] = take(p for (_, p), a in zip(named, is_attn) if not a)
    groups["other"] = take(model.parameters())
    return {name: ps for name, ps in groups.items() if ps}


def vocab_size_of(model: nn.Module, head: nn.Module | None) -> int | None:
    if isinstance(head, nn.Linear):
        return head.out_features
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None


def head_count_of(blocks: list[nn.Module], width: int) -> int:
    """The blocks' attention head count (read off the usual attributes; 1 where none is found), if the
    width splits into heads of even size; else 1."""
    for m in blocks[0].modules():
        for owner in (m, getattr(m, "config", None)):
            n = next((getattr(owner, a) for a in HEAD_COUNTS if isinstance(getattr(owner, a, None), int)), None)
            if n and width % n == 0 and (width // n) % 2 == 0:
                return n
    return 1
