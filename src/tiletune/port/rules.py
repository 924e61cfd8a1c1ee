"""The migration rules: what in CUDA source silently breaks (or stops compiling) on AMD GPUs.

Each rule is data: an id, a severity (SARIF levels: error, warning, note), what breaks on AMD, the
fix, and either a regex applied line by line to comment-free source or a `check` function where
the rule has to follow a value a little: evaluate shared-memory sizes, trace a mask to its warp call,
see whether 32 is applied to a thread index, find what declares an object, bound a launch's block. Facts the messages rely on:

- CDNA GPUs (MI200 = gfx90a, MI300 = gfx942) run 64-lane wavefronts; RDNA (gfx1100) runs 32 by
  default. `warpSize` is the portable spelling; hard-coded 32 is wrong on CDNA.
- Ballot and active masks are 64-bit on AMD; HIP's `*_sync` warp functions (ROCm >= 6.2) want a
  64-bit mask, ROCm < 6.2 has only the unmasked `__shfl_xor`, `__ballot`, ... forms.
- An AMD workgroup gets at most 64 KiB of LDS (shared memory) on gfx90a, gfx942 and gfx1100.
"""

from __future__ import annotations

import ast
import bisect
import functools
import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tiletune.port.preprocessor import CUDA_ARCH_NAME, DEFINED_ON_AMD, Build, Directive, dead_lines, directives, on_amd

LDS_LIMIT_BYTES = 64 * 1024


@dataclass(frozen=True)
class Hit:
    """One place a `check` function flags: 1-based line and column, plus rule-specific detail."""

    line: int
    column: int
    detail: str = ""
    severity: str | None = None  # overrides the rule's severity when set


@dataclass(frozen=True)
class Rule:
    """A migration rule; see the module docstring for how `pattern` and `check` apply."""

    id: str
    severity: str
    title: str
    breaks: str
    fix: str
    before: str  # CUDA that hits the rule
    after: str  # the ported line
    pattern: re.Pattern | None = None
    check: Callable[[str], Iterable[Hit]] | None = None
    reads_dead_code: bool = False  # the check gets the branches hipcc compiles out too (else they are blanked)
    reads_build: bool = False  # the check gets the HIP build's macros (`Build`: hipify's -D / -U) as a second argument


def pattern_hits(pattern: re.Pattern, lines: list[str]) -> list[Hit]:
    """The first match of `pattern` on each of `lines` (a source split once): how a rule with a `pattern` fires."""
    return [Hit(number, match.start() + 1) for number, line in enumerate(lines, start=1)
            if (match := pattern.search(line)) is not None]


# ---- shared-memory sizes: a small evaluator for the constant expressions kernels use ----------

_SIZEOF = {
    "char": 1, "int8_t": 1, "uint8_t": 1, "__nv_fp8_e4m3": 1, "__nv_fp8_e5m2": 1,
    "half": 2, "__half": 2, "__nv_bfloat16": 2, "nv_bfloat16": 2, "short": 2, "int16_t": 2,
    "float": 4, "int": 4, "unsigned": 4, "uint32_t": 4, "int32_t": 4, "half2": 4, "__half2": 4,
    "__nv_bfloat162": 4, "double": 8, "long": 8, "size_t": 8, "int64_t": 8, "uint64_t": 8,
    "float2": 8, "float4": 16, "int4": 16, "uint4": 16, "double2": 16,
}
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+(.+)$", re.MULTILINE)
_CONST = re.compile(r"\b(?:constexpr|const)\b[^;=(){}]*?\b(\w+)\s*=\s*([^;{}]+);")
_INT_SUFFIX = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b")
_SIZEOF_CALL = re.compile(r"\bsizeof\s*\(\s*([\w:]+)\s*\)")
_CAST = re.compile(r"\bstatic_cast\s*<[^>]*>|\(\s*(?:unsigned\s+)?(?:size_t|int|unsigned|long|uint32_t|int64_t)\s*\)")
_INT_OPS = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a // b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
    ast.BitOr: lambda a, b: a | b, ast.BitAnd: lambda a, b: a & b,
}


def source_constants(text: str) -> dict[str, str]:
    """Map names from `#define NAME expr` and `const[expr] T NAME = expr[, NAME2 = expr];` to expressions."""
    constants = {}
    for match in _CONST.finditer(text):
        first, *others = split_arguments(match.group(2))
        constants[match.group(1)] = first
        constants.update(part.split("=", 1) for part in others if "=" in part)
    constants = {name.strip(): expr.strip() for name, expr in constants.items()}
    constants.update((m.group(1), m.group(2).strip()) for m in _DEFINE.finditer(text))
    return constants


def evaluate_int(expr: str, constants: dict[str, str], depth: int = 0) -> int | None:
    """Value of a C integer constant expression (literals, named constants, sizeof, + - * / % << >>).

    Returns None when the expression depends on anything not known at compile time.
    """
    if depth > 8:
        return None
    expr = _SIZEOF_CALL.sub(lambda m: str(_SIZEOF.get(m.group(1).split("::")[-1], "x")), expr)
    expr = _INT_SUFFIX.sub(r"\1", _CAST.sub("", expr))
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        return None

    def value(node: ast.AST) -> int | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in constants:
            return evaluate_int(constants[node.id], constants, depth + 1)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = value(node.operand)
            return None if operand is None else (-operand if isinstance(node.op, ast.USub) else operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _INT_OPS:
            left, right = value(node.left), value(node.right)
            if left is None or right is None or (right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod))):
                return None
            return _INT_OPS[type(node.op)](left, right)
        return None

    return value(tree)


def split_arguments(args: str) -> list[str]:
    """Split a comma-separated argument list, ignoring commas nested in (), [], {}."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(args):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(args[start:i])
            start = i + 1
    parts.append(args[start:])
    return [part.strip() for part in parts]


def _balanced_args(text: str, open_paren: int) -> str:
    """The text between the parenthesis at `open_paren` and its matching close."""
    depth = 0
    for i in range(open_paren, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_paren + 1 : i]
    return text[open_paren + 1 :]


def _line_starts(lines: list[str]) -> list[int]:
    """The offset of each of `lines` (a text split at its newlines) in that text, and the text's length plus one."""
    return [0, *itertools.accumulate(len(line) + 1 for line in lines)]


def _position(text: str, index: int) -> tuple[int, int]:
    line_start = text.rfind("\n", 0, index) + 1
    return text.count("\n", 0, index) + 1, index - line_start + 1


# `if (offset > 16) __syncthreads();` / `if (s >= WARP_SIZE) { __syncthreads(); }`: the barrier, alone in its branch,
# left out for the steps within 32 lanes (not a block-level combine that only a block of several warps needs:
# `if (block_size > WARP_SIZE) { __syncthreads(); ...store and reload the warps' sums }`)
_SKIPPED_BARRIER = re.compile(r"\bif\s*\(\s*[\w.]+\s*>=?\s*(?:16|32|\w*WARP_SIZE\w*|warpSize)\s*\)\s*"
                              r"(?:__syncthreads\s*\(\s*\)\s*;|\{\s*__syncthreads\s*\(\s*\)\s*;\s*\})")


def check_skipped_barrier(text: str) -> Iterable[Hit]:
    """Flag a block barrier a reduction skips once its stride is within 32 lanes (the `if`, across lines)."""
    for match in _SKIPPED_BARRIER.finditer(text):
        yield Hit(*_position(text, match.start()))


_SET_ATTRIBUTE = re.compile(r"\b(?:cuda|hip)FuncSetAttribute\s*\(")
_LAUNCH = re.compile(r"<<<(.*?)>>>", re.DOTALL)
_LAUNCH_EX_SMEM = re.compile(r"\bdynamicSmemBytes\s*=\s*([^;]+);")
_STATIC_SHARED = re.compile(r"__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([\w:]+)\s+\w+\s*((?:\[[^\]]+\]\s*)+);")


def _shared_memory_requests(text: str) -> Iterable[tuple[int, str, str]]:
    """Yield (offset, what, byte-count expression) for each shared-memory size the source sets."""
    for match in _SET_ATTRIBUTE.finditer(text):
        args = split_arguments(_balanced_args(text, match.end() - 1))
        if len(args) == 3 and args[1].endswith("MaxDynamicSharedMemorySize"):
            yield match.start(), "the dynamic shared memory limit set here", args[2]
    for match in _LAUNCH.finditer(text):
        args = split_arguments(match.group(1))
        if len(args) >= 3:
            yield match.start(), "this launch", args[2]
    for match in _LAUNCH_EX_SMEM.finditer(text):
        yield match.start(), "this launch config", match.group(1)
    for match in _STATIC_SHARED.finditer(text):
        dims = re.findall(r"\[([^\]]+)\]", match.group(2))
        yield match.start(), "this static __shared__ array", "*".join(
            [f"sizeof({match.group(1)})", *(f"({dim})" for dim in dims)]
        )


def _largest_size(expr: str, offset: int, text: str, constants: dict[str, str]) -> int | None:
    """`expr` evaluated with each variable of it that the enclosing function only ever sets to constants taken at
    its largest (`int extra = 0; if (big) extra = 256;` -> 256), or None when some value is unknown."""
    function = enclosing_function(text, offset)
    if function is None:
        return None
    scope, bounded = text[function.body_start : function.body_end], dict(constants)
    for name in set(_NAME.findall(expr)) - set(constants):
        values = [evaluate_int(source, constants) for source in _definitions(name, scope)]
        if values and None not in values:
            bounded[name] = str(max(values))
    return evaluate_int(expr, bounded)


def check_shared_memory(text: str) -> Iterable[Hit]:
    """Flag shared-memory sizes above the 64 KiB of LDS; warn where an attribute's size is unknown (a variable the
    function sets to constants counts at its largest)."""
    constants = source_constants(text)
    for offset, what, expr in _shared_memory_requests(text):
        line, column = _position(text, offset)
        size = evaluate_int(expr, constants)
        if size is None and what.startswith("the dynamic shared memory limit"):
            size = _largest_size(expr, offset, text, constants)
        if size is not None and size > LDS_LIMIT_BYTES:
            yield Hit(line, column, f"{what} asks for {size} bytes ({size / 1024:g} KiB)")
        elif size is None and what.startswith("the dynamic shared memory limit"):
            yield Hit(line, column, f"size `{expr}` is not a compile-time constant: make sure it stays <= 64 KiB",
                      severity="warning")


# ---- lane masks: 32-bit masks that reach a warp function ------------------------------------------

_MASK32 = r"(?:0[xX][fF]{8}(?![0-9a-fA-F])[uUlL]*|~0[uU]?\b|\(unsigned\)\s*-1|uint32_t\(-1\))"
# an all-ones mask written as a negative int or unsigned (`-1u`) in the call itself: 32 bits wide too (HIP's `*_sync`
# functions take the mask's type as a template parameter and assert it is 8 bytes)
_MASK32_ARGUMENT = rf"(?:{_MASK32}|-1[uU]?(?!\w))"
_WARP_SYNC_MASK = re.compile(
    rf"\b__(?:shfl(?:_up|_down|_xor)?|ballot|any|all|uni|match_any|match_all|reduce_\w+)_sync\s*\("
    rf"\s*({_MASK32_ARGUMENT}|\w+)"
)
# a project's shuffle wrapper named after them (TileLang's `tl::shfl_down_sync(MASK, v, o)`), read only where its first
# argument is an all-ones literal or a name the file binds to one (its other overloads take no mask)
_WRAPPER_SYNC_MASK = re.compile(rf"(?<!\w)(?:\w+::)*shfl(?:_up|_down|_xor)?_sync\s*\(\s*({_MASK32}|\w+)")
_MASK32_BINDING = re.compile(rf"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+\(?{_MASK32}|\b(\w+)\s*=\s*{_MASK32}", re.MULTILINE)


_INT_LITERAL_32 = re.compile(r"(?:0[xX][0-9a-fA-F]{1,8}|\d+)[uU]?")  # no `ll` suffix: an int or unsigned


_DECLARATION_WORDS = {"const", "unsigned", "signed", "int", "long", "uint32_t", "uint64_t", "int32_t", "int64_t",
                      "auto", "volatile", "lane_mask_t"}


def _narrow_declaration(name: str) -> re.Pattern:
    """`name` declared with a 32-bit integer type: `int m = ...`, `unsigned mask`, `const uint& mask`."""
    return re.compile(rf"\b(?:unsigned(?:\s+int)?|uint32_t|int32_t|uint|int)\s*(?:const\s*)?&?\s*{name}\b(?!\s*[(\[])")


def _unused_parameter(text: str, name: str, offset: int) -> bool:
    """Whether `offset` is in the parameter list of a function of `text` whose body (as AMD compiles it) never
    names `name`: a mask parameter only a CUDA branch used (`unsigned mask = 0xffffffff` for `#if CUDA_VERSION`)."""
    for function in functions(text):
        if offset < function.body_start and not re.search(r"[;{}]", text[offset : function.body_start - 1]):
            return not re.search(rf"\b{re.escape(name)}\b", text[function.body_start : function.body_end])
    return False


def check_lane_masks(text: str) -> Iterable[Hit]:
    """Flag where a 32-bit mask is written: an all-ones mask or any other integer literal without an
    `ll` suffix (`0x55555555`) as the mask argument of a `*_sync` warp function, an all-ones constant or
    variable that such a call uses (or whose name says mask) and each call using it, a mask parameter or
    variable declared 32 bits wide, a type for lane masks declared 32 bits wide (`using lane_mask_type = uint32;`),
    and (a warning) a mask constant defined in another file."""
    bindings: dict[str, list[int]] = {}  # each place a name is bound (two functions may each declare `mask`)
    for match in _MASK32_BINDING.finditer(text):
        bindings.setdefault(match.group(1) or match.group(2), []).append(match.start())
    masks_used = set()
    wrapped = [call for call in _WRAPPER_SYNC_MASK.finditer(text)
               if re.fullmatch(_MASK32, call.group(1)) or call.group(1) in bindings]
    for match in sorted([*_WARP_SYNC_MASK.finditer(text), *wrapped], key=lambda call: call.start()):
        mask = match.group(1)
        if re.fullmatch(_MASK32_ARGUMENT, mask):
            yield Hit(*_position(text, match.start()))
        elif _INT_LITERAL_32.fullmatch(mask):
            yield Hit(*_position(text, match.start()), f"`{mask}` is a 32-bit integer")
        elif (mask[0].isalpha() or mask[0] == "_") and mask not in _DECLARATION_WORDS:  # not the overload's own header
            masks_used.add(mask)
            name = re.escape(mask)
            narrow = _narrow_declaration(name).search(text)
            if mask in bindings or narrow:
                # the binding this call sees: the last one before it (its function's), else the first in the file
                before = [offset for offset in bindings.get(mask, ()) if offset < match.start()]
                line = _position(text, before[-1] if before else bindings[mask][0] if mask in bindings
                                 else narrow.start())[0]
                yield Hit(*_position(text, match.start()), f"`{mask}` (line {line}) is a 32-bit mask")
            elif not re.search(rf"#\s*define\s+{name}\b|\b{name}\s*=(?!=)|\b\w+[\s*&]+{name}\s*[,;)=\[]", text):
                yield Hit(*_position(text, match.start()), f"`{mask}` is defined in another file: HIP's "
                          "`*_sync` functions need it 64 bits wide", severity="warning")
    for name, offsets in bindings.items():  # flagged once, at its last binding; each call above names its own
        offset = offsets[-1]
        if name in masks_used or ("mask" in name.lower() and not _unused_parameter(text, name, offset)):
            yield Hit(*_position(text, offset), f"`{name}` holds a 32-bit mask")
    for name in masks_used:  # a mask parameter or variable declared 32 bits wide (an all-ones one said so above)
        for declaration in _narrow_declaration(re.escape(name)).finditer(text):
            # an all-ones one is said above; one holding a ballot, by ballot-32bit-result
            if not re.match(rf"\s*=\s*(?:\(?{_MASK32}|__(?:ballot|activemask))", text[declaration.end() :]):
                yield Hit(*_position(text, declaration.start()), f"`{name}` is declared 32 bits wide")
    for alias in _MASK_TYPE_32.finditer(text):
        name = alias.group(1) or alias.group(2)
        yield Hit(*_position(text, alias.start()), f"`{name}` is a 32-bit type for lane masks")


# a type for lane masks declared 32 bits wide: `using lane_mask_type = uint32;`, `typedef unsigned warp_mask_t;`
_MASK_TYPE_32 = re.compile(r"\busing\s+(\w*(?i:lane_?mask|warp_?mask|ballot)\w*)\s*=\s*(?:std::)?"
                           r"(?:uint32(?:_t)?|unsigned(?:\s+int)?|int)\s*;"
                           r"|\btypedef\s+(?:std::)?(?:uint32(?:_t)?|unsigned(?:\s+int)?|int)\s+"
                           r"(\w*(?i:lane_?mask|warp_?mask|ballot)\w*)\s*;")


_BALLOT_HELD = re.compile(r"\b(\w+)\s*=\s*(?:__(?:ballot(?:_sync)?|activemask)|\w+\s*\.\s*ballot|[A-Z_]*BALLOT[A-Z_]*)\s*\(")
_INT_ONE_SHIFT = r"\(?\s*1[uU]?\s*<<"  # an `int` (or `unsigned`) 1: 32 bits, whatever it is shifted by


def check_ballot_bit_tests(text: str) -> Iterable[Hit]:
    """Flag a lane's bit of a ballot (a name assigned from `__ballot_sync`, `__activemask`, a group's `ballot`)
    tested with a 32-bit one, `mask & (1 << j)`: for lanes 32-63 of a 64-lane wavefront the shift is undefined
    and the test never sees their bits."""
    names = {match.group(1) for match in _BALLOT_HELD.finditer(text)}
    if not names:
        return
    held = "|".join(map(re.escape, sorted(names)))
    test = re.compile(rf"\b(?:{held})\s*&\s*{_INT_ONE_SHIFT}|{_INT_ONE_SHIFT}[^()&|;]*\)\s*&\s*(?:{held})\b")
    for match in test.finditer(text):
        yield Hit(*_position(text, match.start()))


# ---- lane arithmetic: 32 applied to a thread index, and where a lane-0 test matters ---------------

_LANE_NAMES = re.compile(r"threadIdx|blockDim|\btid\b|thread_?id|lane|warp|\bwid\b", re.IGNORECASE)
# Thread counts compared with one warp: `blockSize > 32`. (`kNThreads / 32` is left alone: it is as
# often a tile decomposition as a warp count.)
_THREAD_COUNT_NAMES = re.compile(r"block_?size|num_?threads|n_?threads|threads_?per_?block", re.IGNORECASE)
_HEX_32, _HEX_31 = r"0[xX]0*20", r"0[xX]0*1[fF]"  # 32 and 31 written in hex (`& 0x1f`, `% 0x20`)
_WARP_LITERAL = re.compile(
    rf"[%/*]\s*(?:32|{_HEX_32})[uU]?\b(?!\.)|&\s*(?:31|{_HEX_31})[uU]?\b|>>\s*5\b|<<\s*5\b"
    rf"|(?<![<>])<\s*(?:32|{_HEX_32})[uU]?\b(?!\.)(?!\s*>)|==\s*(?:31|{_HEX_31})[uU]?\b"  # `lane == 31`: the last lane
)
# the last lane's test written the other way round: `if (31 == laneId)`
_LAST_LANE_FIRST = re.compile(rf"(?<![\w.])(?:31|{_HEX_31})[uU]?\s*==\s*([\w.]+)")
_THREAD_COUNT_LITERAL = re.compile(r"(?<![<>-])>=?\s*32[uU]?\b(?!\.)")
_THREADS_OF_WARPS = re.compile(r"(?<![\w.])32[uU]?\s*\*\s*(\w*(?i:warps)\w*)\b")  # `32 * num_warps`
_LANE_ZERO_TEST = re.compile(r"\s*\)?\s*==\s*0\b")
_WARP_WIDE_USE = re.compile(  # warp functions, or an index that is a warp id
    r"__shfl|__ballot|__activemask|__any|__all|__reduce_|\w+\s*\[[^\]]*(?:/\s*32|>>\s*5|warp|\bwid\b)[^\]]*\]", re.IGNORECASE
)


def _left_operand(line: str, end: int) -> str:
    """The operand written just before `line[end]`: a name such as `threadIdx.x`, or a parenthesised
    group with the call or cast in front of it."""
    head = line[:end].rstrip()
    start = len(head)
    if head.endswith(")"):
        depth = 0
        for start in range(len(head) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(head[start], 0)
            if depth == 0:
                break
    return head[re.search(r"[\w.\[\]>-]*$", head[:start]).start():]


_BLOCK_BARRIER = re.compile(r"\s*(?:__syncthreads\s*\(|cg::sync\s*\(|(?:cta|block|b)\s*\.\s*sync\s*\()")


def _barrier_step(lines: list[str], index: int, warp_calls: re.Pattern | None = None) -> bool:
    """Whether `lines[index]` is `if (...)` guarding one step of a shared-memory tree reduction: no
    shuffle, vote or per-warp index inside, nor a call of the file's warp-level functions (`warp_calls`), and a block
    barrier as the next statement. Such a step is correct for any warp width (`if (tid < 32) s[tid] += s[tid + 32];
    __syncthreads();`)."""
    if not re.match(r"\s*if\s*\(", lines[index]):
        return False
    depth = 0
    for end in range(index, min(index + 8, len(lines))):
        depth += lines[end].count("{") - lines[end].count("}")
        if depth <= 0 and ("}" in lines[end] or ";" in lines[end]):
            break
    else:
        return False
    following = next((line for line in lines[end + 1 : end + 4] if line.strip()), "")
    guarded = "\n".join(lines[index : end + 1])
    return (not _WARP_WIDE_USE.search(guarded) and not (warp_calls and warp_calls.search(guarded))
            and bool(_BLOCK_BARRIER.match(following)))


def check_lane_arithmetic(text: str) -> Iterable[Hit]:
    """Flag `% 32`, `/ 32`, `& 31`, `>> 5`, `< 32`, `== 31`... applied to a thread, lane or warp index (or to a name
    holding `threadIdx.x`, divided or masked: `auto first = threadIdx.x; ... i = first; ... i / 32`), `31 == lane`,
    `> 32` applied to a thread count (`if (blockSize > 32)`: more than one warp), `32 *` a warp count (`32 * num_warps`:
    threads), and a loop from the hardware lane id
    stepping by 32 (`lane = threadIdx.x % warpSize; for (j = lane; j < n; j += 32)`) or from a lane id whose `% 32`
    is flagged here (fixing that lane id to count 64 lanes leaves the step wrong). A lane-0
    test (`threadIdx.x % 32 == 0`) is flagged only when the statement it guards shuffles, votes or
    indexes a per-warp array: picking one thread per 32 is otherwise harmless. A step of a tree
    reduction with a block barrier after it (calling none of the file's warp-level functions) is left alone, and so is
    a function that does nothing warp-wide
    (`lane_blind_functions`): there 32 only lays out data. Nothing is flagged in a file whose warp-level code all
    stays in 32-lane groups (`_logical_32_lane_groups`): its lane arithmetic by 32 agrees with its shuffles."""
    if _logical_32_lane_groups(text):
        return
    lines = text.splitlines()
    line_starts = _line_starts(lines)
    flagged_lanes = set()  # names given a lane id `% 32` that was flagged: loops from them stepping by 32 follow
    blind = {f.name for f in lane_blind_functions(text)}
    warp_level = sorted({f.name for f in functions(text)} - blind)
    warp_calls = re.compile(rf"\b(?:{'|'.join(map(re.escape, warp_level))})\s*(?:<[^;{{}}]*?>)?\s*\(") if warp_level else None
    thread_index = _thread_index_aliases(text)
    for number, line in enumerate(lines, start=1):
        if _barrier_step(lines, number - 1, warp_calls) or in_lane_blind_function(text, line_starts[number - 1]):
            continue
        for match in _LAST_LANE_FIRST.finditer(line):
            if _LANE_NAMES.search(match.group(1)):
                yield Hit(number, match.start() + 1, f"`{match.group(1)}` compared with 31, the last of 32 lanes")
        for match in _THREAD_COUNT_LITERAL.finditer(line):
            operand = _left_operand(line, match.start())
            if _THREAD_COUNT_NAMES.search(operand) and not _LANE_NAMES.search(operand):
                yield Hit(number, match.start() + 1, f"`{operand.strip()}` is a thread count: 32 here is one NVIDIA warp")
        for match in _THREADS_OF_WARPS.finditer(line):
            yield Hit(number, match.start() + 1, f"32 x `{match.group(1)}`: threads of that many 32-lane warps")
        for match in _WARP_LITERAL.finditer(line):
            operand = _left_operand(line, match.start())
            warp_count = (_THREAD_COUNT_NAMES.search(operand) and match.group(0).lstrip()[0] in "/>"
                          and in_warp_level_launcher(text, line_starts[number - 1]))
            # or the result is named a lane id, whatever it was taken from (`lane_id = sq_id % 32`)
            assigned = _ASSIGNED_BEFORE.search(line[: match.start()])
            named_lane = match.group(0).lstrip()[0] in "%&" and assigned and _LANE_ID_NAME.fullmatch(assigned.group(1))
            # a thread index under another name, divided or masked into a warp or lane id (its `* 32` lays out data)
            aliased = operand.strip() in thread_index and match.group(0).lstrip()[0] in "/%&>"
            if not (_LANE_NAMES.search(operand) or aliased or warp_count or named_lane):
                continue
            if _LANE_ZERO_TEST.match(line, match.end()):
                guarded = "\n".join([line[match.end():], *lines[number : number + 3]])
                if not _WARP_WIDE_USE.search(guarded):
                    continue
            yield Hit(number, match.start() + 1)
            if match.group(0).lstrip()[0] in "%&" and (assigned := _ASSIGNED_BEFORE.search(line[: match.start()])):
                flagged_lanes.add(assigned.group(1))
    hardware_lanes = set(_HARDWARE_LANE.findall(text))
    for number, line in enumerate(lines, start=1):
        for match in _LANE_STRIDE_LOOP.finditer(line):
            names = set(re.findall(r"\w+", start := match.group(1)))
            if re.search(r"%\s*warpSize|\w*(?i:lane_?id)\s*\(", start) or hardware_lanes & names:
                yield Hit(number, match.start() + 1, "a loop from the hardware lane id stepping by 32: on a 64-lane "
                          "wavefront lanes 32-63 repeat lanes 0-31's iterations")
            elif flagged_lanes & names:
                yield Hit(number, match.start() + 1, "a loop from a lane id taken modulo 32 (flagged above) stepping by "
                          "32: once the lane id counts a 64-lane wavefront, the step must be warpSize too")


_INDEX_COPY = re.compile(r"\b(\w+)\s*=\s*([\w.]+)\s*[;,)]")  # `auto first = threadIdx.x;`, `for (auto i = first; ...`


def _thread_index_aliases(text: str) -> set[str]:
    """Names set to `threadIdx.x` itself, or to such a name (`auto first = threadIdx.x; for (auto i = first; ...`):
    a thread index under another name, whose `/ 32` is a warp id as `threadIdx.x / 32` is."""
    copies = _INDEX_COPY.findall(text)
    aliases: set[str] = set()
    while True:
        found = {name for name, source in copies if source == "threadIdx.x" or source in aliases} - aliases
        if not found:
            return aliases
        aliases |= found


# A lane id of the hardware's warp (`lane = threadIdx.x % warpSize`, `__lane_id()`): a loop from it stepping by 32
# repeats iterations on a 64-lane wavefront. (From `threadIdx.x % 32` the same loop is a consistent 32-lane group.)
_HARDWARE_LANE = re.compile(r"\b(\w+)\s*=\s*[^;=]*(?:%\s*warpSize\b|&\s*\(\s*warpSize\s*-\s*1\s*\)"
                            r"|\b\w*(?i:lane_?id)\s*\(\s*\))")  # __lane_id(), cub::LaneId(), get_lane_id()
_LANE_ID_NAME = re.compile(r"\w*(?i:lane)_?(?i:id|idx|index)?\w*")
_ASSIGNED_BEFORE = re.compile(r"\b(\w+)\s*=\s*[^;=,]*$")  # the name a declaration or assignment ending here sets
_LANE_STRIDE_LOOP = re.compile(r"\bfor\s*\([^;]*=\s*([^;]*);[^;]*;\s*\w+\s*\+=\s*32[uU]?\s*\)")


_BLOCK_OF_32 = re.compile(
    r"(?:(\w+)\s*(?:<(?:[^<>]|<[^<>]*>)*>)?\s*)?<<<[^,;>]+,\s*(?:32[uU]?\s*[,>]|dim3\s*\(\s*32[uU]?\s*(?:,\s*1\s*)*\))"
    r"|\bdim3\s+(?P<block>\w+)\s*[({]\s*32[uU]?\s*(?:,\s*1\s*)*[)}]"
    r"|\b\w*(?i:launch)\w*\s*<\s*32[uU]?\s*,"  # launch tables: f_launch<32, kNItems>
    r"|\b\w*(?i:launch_?config)\w*\s*\(\s*[^,()]+,\s*32[uU]?\s*[,)]"  # SETUP_LAUNCH_CONFIG(grid, 32, stream)
    r"|\b(?i:\w*block_?size)\s*=\s*32[uU]?\s*;"  # const int blocksize = 32;
    r"|\b(?i:block\w*|\w*threads\w*)\s*=\s*(?:std::)?max\s*\(\s*(?:32[uU]?\s*,"  # one warp at least
    r"|[^,;()]+,\s*(?:static_cast\s*<[^<>]*>\s*\(\s*)?32[uU]?\s*\)?\s*\))"
)


_ROWS_OF_32 = r"[({]\s*32[uU]?\s*,\s*(?!1\s*[,)}])"  # a block's dimensions: 32 threads by more than one
_KERNEL_LAUNCH = re.compile(r"\b(\w+)\s*(?:<(?:[^<>;{}]|<[^<>;{}]*>)*>)?\s*<<<(.*?)>>>", re.DOTALL)


def check_32_thread_blocks(text: str) -> Iterable[Hit]:
    """Flag a block of 32 threads (a launch, a `dim3`, a launch table's first argument, `max(n, 32)`), except
    the launch of a kernel this file defines that does nothing warp-wide (`lane_blind_functions`), or a named
    `dim3` block that only such launches of its function take: their 32 threads work alike in half a wavefront;
    and blocks of rows of 32 threads for a kernel that works across a warp (`_rows_of_32`)."""
    lane_blind = {function.name for function in lane_blind_functions(text)}
    offset = 0
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        match = _BLOCK_OF_32.search(line)
        if match is not None and match.group(1) not in lane_blind and not (
                match.group("block") and _launches_lane_blind_only(text, offset + match.start(), match.group("block"),
                                                                   lane_blind)):
            yield Hit(number, match.start() + 1)
        offset += len(line)
    yield from _rows_of_32(text, lane_blind)


def _launches_lane_blind_only(text: str, start: int, block: str, lane_blind: set[str]) -> bool:
    """Whether the `dim3` named `block` declared at `start` is the block of at least one launch in its function and
    of none but launches of the file's lane-blind kernels."""
    function = enclosing_function(text, start)
    end = function.body_end if function else len(text)
    launched = [launch.group(1) for launch in _KERNEL_LAUNCH.finditer(text, start, end)
                if len(arguments := split_arguments(launch.group(2))) > 1 and arguments[1].strip() == block]
    return bool(launched) and all(kernel in lane_blind for kernel in launched)


def _rows_of_32(text: str, lane_blind: set[str]) -> Iterable[Hit]:
    """Launches of a kernel of the file that works across a warp with blocks of rows of 32 threads: `dim3(32, 4)`
    in the launch, or a `dim3 threads(32, 4)` of the launching function."""
    defined = functions(text)
    warp_level = {f.name for f in defined if f.device} - lane_blind
    for launch in _KERNEL_LAUNCH.finditer(text):
        arguments = split_arguments(launch.group(2))
        if launch.group(1) not in warp_level or len(arguments) < 2:
            continue
        block = arguments[1].strip()
        if re.match(rf"dim3\s*{_ROWS_OF_32}", block):
            where = launch.start(2) + launch.group(2).find(block)
        else:
            launcher = getattr(enclosing_function(text, launch.start()), "body_start", 0)
            named = re.compile(rf"\bdim3\s+{re.escape(block)}\s*{_ROWS_OF_32}").search(text, launcher, launch.start())
            if named is None:
                continue
            where = named.start()
        yield Hit(*_position(text, where), f"rows of 32 threads for `{launch.group(1)}`, which works across a warp: "
                                           "a 64-lane wavefront holds two rows")


# ---- per-warp arrays: sized by a warp count, read by a lane id ---------------------------------

_WARP_COUNT = (r"(?:32|\w*(?i:num_?warps|warps_per_block|n_?warps)\w*"
               r"|[^\]]*/\s*(?:32|\w*(?i:warp_?size|threads_per_warp)\w*))")
_PER_WARP_ARRAY = re.compile(rf"__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?[\w:]+\s+(\w+)\s*\[\s*{_WARP_COUNT}\s*\]")
_LANE_INDEX = rf"\s*\[\s*(?:\w*(?i:lane)\w*|threadIdx\.x\s*(?:%\s*(?:32|{_HEX_32}|warpSize)|&\s*(?:31|{_HEX_31})))\s*\]"


def check_per_warp_arrays(text: str) -> Iterable[Hit]:
    """Flag reads of a shared array sized by the number of warps (or 32) indexed by a lane id, unless
    the statement compares that index first (`lane < num_warps ? buf[lane] : 0`)."""
    for array in _PER_WARP_ARRAY.finditer(text):
        name = array.group(1)
        for use in re.finditer(rf"\b{re.escape(name)}({_LANE_INDEX})", text[array.end():]):
            offset = array.end() + use.start()
            statement = text[max(text.rfind(";", 0, offset), text.rfind("{", 0, offset)) + 1 : offset]
            index = use.group(1).strip(" []")
            if not re.search(rf"{re.escape(index)}\s*<", statement):
                yield Hit(*_position(text, offset), f"`{name}` has one slot per 32-lane warp")


_WARP_HELPER = re.compile(r"\b(\w*(?i:shuffle|shfl|warp|prefix_?sum|scan|reduce)\w*)\s*(?:<[^;{}()]*?>)?\s*\(")


def check_warp_buffers_passed_on(text: str) -> Iterable[Hit]:
    """Flag a shared array sized by the warp count (`[32]`) handed to a warp-level helper the file does not define
    (`ShufflePrefixSum(v, buf)`, `ReduceBestGain(..., buf)`): how many slots the helper fills (one per warp, or one per
    lane of the first warp, 64 on a 64-lane wavefront) is in another header."""
    defined = {function.name for function in functions(text)} | set(source_constants(text))
    for array in _PER_WARP_ARRAY.finditer(text):
        name, function = array.group(1), enclosing_function(text, array.start())
        end = function.body_end if function else min(len(text), array.end() + 4000)
        for call in _WARP_HELPER.finditer(text, array.end(), end):
            if call.group(1) in defined:
                continue
            if re.search(rf"(?:^|,)\s*&?\s*{re.escape(name)}\s*(?:,|$)", _balanced_args(text, call.end() - 1)):
                yield Hit(*_position(text, array.start()), f"`{name}` goes to `{call.group(1)}`")
                break


# ---- templates: dependent names that hipcc (clang) wants spelled out and nvcc (EDG) guesses -----

_TEMPLATE_HEAD = re.compile(r"\btemplate\s*<((?:[^<>]|<[^<>]*>)*)>")
_MEMBER_TEMPLATE_CALL = re.compile(r"\b(\w+)\s*(\.|->)\s*(?!template\b)(\w+)\s*<(?:[^<>;(){}]|<[^<>;(){}]*>)*>\s*\(")


_TOP_LEVEL_CLOSE = re.compile(r"^\}", re.MULTILINE)


def _template_scopes(text: str) -> Iterable[tuple[int, int, set[str]]]:
    """(start, end, parameter names) of each template: from its `template <...>` head to the first `}`
    in column 0 after it (the end of a top-level function or class body), so a name declared with a
    template parameter in one function does not make another function's same-named variable dependent."""
    for head in _TEMPLATE_HEAD.finditer(text):
        names = set()
        for parameter in split_arguments(head.group(1)):
            words = re.findall(r"\w+", parameter.split("=", 1)[0])
            if len(words) >= 2:
                names.add(words[-1])
        close = _TOP_LEVEL_CLOSE.search(text, head.end())
        if names:
            yield head.start(), close.end() if close else len(text), names


def _dependent_hits(text: str, start: int, end: int, parameters: set[str]) -> Iterable[Hit]:
    scope = text[:end]
    dependent = "|".join(map(re.escape, sorted(parameters)))
    # a class template deriving from a base that names its parameters: `this->member<N>(...)` may be the base's
    head = text[start : text.find("{", start) + 1]
    dependent_base = re.search(rf"\b(?:class|struct)\s+\w+[^{{;]*?:[^{{;]*\b(?:{dependent})\b", head)
    for match in _MEMBER_TEMPLATE_CALL.finditer(scope, start):
        obj, arrow, member = match.groups()
        if obj == "this":
            declared_here = re.search(rf"[\w>&*]\s+{re.escape(member)}\s*\(", text[start:end])  # a member of its own
            if dependent_base and not declared_here:
                yield Hit(*_position(text, match.start(3)), f"write `this->template {member}<...>(...)`: "
                          "a member template of a dependent base")  # fmt: skip
            continue
        declaration = rf"\b(?:{dependent})\b(?:[\w:<>*&]|,\s*)*?[>\s&*]\s*{re.escape(obj)}\s*[;,)=({{\[]"
        if re.search(declaration, text[start : match.start()]):
            yield Hit(*_position(text, match.start(3)), f"write `{obj}{arrow}template {member}<...>(...)`")
    # a member template of a dependent type called without `template`: `vec_cast<T, S>::cast<N>(...)`, `T::get<3>()`
    static_call = re.compile(rf"(?<![\w:])((?:\w+\s*<[^;{{}}()]*\b(?:{dependent})\b[^;{{}}()]*>|(?:{dependent})))"
                             rf"\s*::\s*(?!template\b)(\w+)\s*<[^;{{}}()<>]*>\s*\(")
    for match in static_call.finditer(scope, start):
        yield Hit(*_position(text, match.start(2)), f"write `{match.group(1)}::template {match.group(2)}<...>(...)`")
    typename_missing = re.compile(rf"(?<!typename )(?<![\w:])((?:{dependent})::\w+)\s+[&*]*\w+\s*[;=({{]")
    for match in typename_missing.finditer(scope, start):
        yield Hit(*_position(text, match.start()), f"write `typename {match.group(1)}`")
    # A dependent type built as a temporary, `Ktraits::BlockLoadT(storage).Load(...)`: clang parses the
    # name as a value. Only CamelCase member names: types, not static member functions.
    temporary = re.compile(rf"(?<!typename )(?<![\w:])((?:{dependent})::[A-Z]\w*)\s*\([^();]*\)\s*(?:\.|->)")
    for match in temporary.finditer(scope, start):
        yield Hit(*_position(text, match.start()), f"write `typename {match.group(1)}(...)`")


def check_dependent_names(text: str) -> Iterable[Hit]:
    """Flag, inside a template, `obj.member<...>(` without `template` where `obj` is declared there with a
    type naming a template parameter, `Type<Param>::member<...>(` and `Param::member<...>(` likewise,
    `this->member<...>(` in a class template whose base names its parameters (and which declares no `member`
    itself), `Param::name var` without `typename`, and `Param::Type(args).f()`."""
    hits = {}
    for start, end, parameters in _template_scopes(text):
        for hit in _dependent_hits(text, start, end, parameters):
            hits.setdefault((hit.line, hit.column), hit)
    yield from sorted(hits.values(), key=lambda hit: (hit.line, hit.column))


# ---- constexpr initialisers that call the host standard library's min/max ----------------------

_CONSTEXPR_INIT = re.compile(r"\bconstexpr\b[^;{}()]*?\b\w+\s*=(?!=)")
_STD_MINMAX = re.compile(r"\bstd::(?:max|min)\s*\(")


def check_constexpr_minmax(text: str) -> Iterable[Hit]:
    """Flag `std::max(` / `std::min(` inside a `constexpr` variable's initialiser (up to its `;`, across lines)."""
    for declaration in _CONSTEXPR_INIT.finditer(text):
        end = text.find(";", declaration.end())
        initialiser = text[declaration.end() : end if end >= 0 else len(text)]
        for call in _STD_MINMAX.finditer(initialiser):
            yield Hit(*_position(text, declaration.end() + call.start()))


# ---- libcu++: report each file once, where it includes the headers (or first uses cuda::std) -----

# libcu++'s headers have no extension (`<cuda/std/atomic>`, `<cuda/barrier>`); a `"cuda/helpers.h"` is the project's own
_LIBCUDACXX_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*[<\"]cuda/(?:std/)?\w[\w/]*[>\"]", re.MULTILINE)
_LIBCUDACXX_USE = re.compile(r"\bcuda::std::")


def check_libcudacxx(text: str) -> Iterable[Hit]:
    """Flag every libcu++ `#include <cuda/...>` (no extension); when there is none, the first `cuda::std::` (one fix
    covers the file)."""
    includes = list(_LIBCUDACXX_INCLUDE.finditer(text))
    first_use = _LIBCUDACXX_USE.search(text)
    for match in includes or ([first_use] if first_use else []):
        yield Hit(*_position(text, match.start() + len(match.group(0)) - len(match.group(0).lstrip())))


# ---- bfloat16: one finding where the file takes CUDA's bf16 -------------------------------------

_BF16_INCLUDE = re.compile(r"^[ \t]*#\s*include\s*[<\"]cuda_bf16\.h[>\"]", re.MULTILINE)
_BF16_USE = re.compile(r"\b__nv_bfloat162?\b|\bnv_bfloat162?\b")


def check_bf16(text: str) -> Iterable[Hit]:
    """Flag each `#include <cuda_bf16.h>`, or without one the first use of a CUDA bf16 type: one check of the
    file's bf16 intrinsics covers every use (counted in the detail)."""
    uses = len(_BF16_USE.findall(text))
    detail = f"{uses} use{'s' if uses != 1 else ''} of CUDA's bf16 types in this file" if uses else ""
    includes = list(_BF16_INCLUDE.finditer(text))
    first_use = _BF16_USE.search(text)
    for match in includes or ([first_use] if first_use else []):
        yield Hit(*_position(text, match.start() + len(match.group(0)) - len(match.group(0).lstrip())), detail)


# ---- launch bounds: kernels launched with more threads than the compiler assumes without them ----

LAUNCH_BOUNDS_DEFAULT = 1024  # hip-clang's default maximum work-group size (ROCm 5.2's hipcc; ROCm 3.x's: 256)
LAUNCH_BOUNDS_FLOOR = 256  # smaller blocks: registers rarely what limits them
_KERNEL = re.compile(r"\b__global__\b")
_BLOCK_SIZE_NAME = re.compile(r"block_?size|threads|block_?dim", re.IGNORECASE)
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


def _kernel_name(text: str, start: int) -> tuple[str, bool]:
    """The name of the kernel declared from `start` (just past `__global__`) and whether it has
    `__launch_bounds__` before its parameter list."""
    bounded = "__launch_bounds__" in text[text.rfind("\n", 0, start) : start]
    while (paren := text.find("(", start)) >= 0:
        word = re.search(r"(\w*)\s*$", text[start:paren]).group(1)
        if word != "__launch_bounds__":
            return word, bounded
        bounded = True
        start = paren + len(_balanced_args(text, paren)) + 2
    return "", bounded


def _definitions(name: str, scope: str) -> Iterable[str]:
    """Expressions `name` is given in `scope`: `name = e;`, `dim3 name(e);`, `name.x = e;`."""
    for match in re.finditer(rf"\b{re.escape(name)}\s*(?:\.[xyz]\s*)?=(?!=)\s*([^;]+);"
                             rf"|\bdim3\s+{re.escape(name)}\s*[({{]([^;]*)[)}}]\s*;", scope):
        yield match.group(1) or match.group(2)


def _out_parameter(name: str, scope: str, text: str) -> str | None:
    """Body of the function defined in `text` that `scope` calls with `name` as an argument, with the
    parameter renamed to `name` (`dim3 block; configure(n, block);` -> configure's `block` assignments)."""
    for call in re.finditer(r"\b(\w+)\s*\(", scope):
        arguments = split_arguments(_balanced_args(scope, call.end() - 1))
        if name not in arguments:
            continue
        definition = re.search(rf"\b{call.group(1)}\s*\(([^;{{}}]*)\)\s*\{{", text)
        if definition is None:
            continue
        parameters = split_arguments(definition.group(1))
        if len(parameters) <= arguments.index(name):
            continue
        parameter = re.findall(r"\w+", parameters[arguments.index(name)].split("=", 1)[0])[-1]
        close = _TOP_LEVEL_CLOSE.search(text, definition.end())
        body = text[definition.end() : close.start() if close else len(text)]
        return re.sub(rf"\b{parameter}\b", name, body)
    return None


def _block_bound(expr: str, scope: str, text: str, constants: dict[str, str], depth: int = 0) -> int | None:
    """The most threads a launch's block expression can hold: its value when constant, else the largest
    block-size constant (`MAX_BLOCK_SIZE`) that the variables it is built from are computed with."""
    value = evaluate_int(expr, constants)
    if value is not None or depth > 3:
        return value
    bounds = []
    for name in set(_NAME.findall(expr)):
        where = scope
        if not any(_definitions(name, scope)) and (body := _out_parameter(name, scope, text)) is not None:
            where = body
        sources = list(_definitions(name, where))
        bounds += [_block_bound(source, where, text, constants, depth + 1) for source in sources]
        if not sources and name in constants and _BLOCK_SIZE_NAME.search(name):
            bounds.append(evaluate_int(constants[name], constants))
    bounds = [bound for bound in bounds if bound is not None]
    return max(bounds, default=None)


def _most_threads(name: str, text: str, constants: dict[str, str]) -> int:
    """The largest block bound among the launches of kernel `name` in `text` (0 when none is known);
    each block expression is followed in the function that launches it."""
    bounds = []
    for launch in re.finditer(rf"\b{name}\s*(?:<(?:[^<>;]|<[^<>;]*>)*>)?\s*<<<(.*?)>>>", text, re.DOTALL):
        arguments = split_arguments(launch.group(1))
        opening = [close.end() for close in _TOP_LEVEL_CLOSE.finditer(text, 0, launch.start())]
        scope = text[opening[-1] if opening else 0 : launch.start()]
        if len(arguments) >= 2:
            bounds.append(_block_bound(arguments[1], scope, text, constants))
    return max((bound for bound in bounds if bound is not None), default=0)


def check_launch_bounds(text: str) -> Iterable[Hit]:
    """Flag each kernel without `__launch_bounds__` (on any of its declarations) that this file launches
    with more than 256 threads but fewer than hip-clang's default 1024, once, where it is first declared; a
    runtime block size counts by the block-size constant it is capped with."""
    kernels = [(kernel.start(), *_kernel_name(text, kernel.end())) for kernel in _KERNEL.finditer(text)]
    bounded = {name for _, name, has_bounds in kernels if has_bounds}
    constants = source_constants(text)
    for offset, name, _ in kernels:
        if not name or name in bounded:
            continue
        bounded.add(name)  # reported once
        most = _most_threads(name, text, constants)
        if LAUNCH_BOUNDS_FLOOR < most < LAUNCH_BOUNDS_DEFAULT:
            yield Hit(*_position(text, offset), f"`{name}` is launched with up to {most} threads")


_LAUNCH_BOUNDS_CALL = re.compile(r"__launch_bounds__\s*\(")


def check_launch_bounds_min_blocks(text: str) -> Iterable[Hit]:
    """Flag `__launch_bounds__(threads, min_blocks)` where HIP's reading of the second argument (minimum waves
    per execution unit, four EUs to a CU) asks for more occupancy than CUDA's (blocks per SM) did: min_blocks
    above 1 with blocks of fewer than 256 threads, or values the file does not fix. Then the compiler squeezes
    registers (and may spill) for an occupancy the author never asked for; otherwise the hint is only looser."""
    constants = source_constants(text)
    for call in _LAUNCH_BOUNDS_CALL.finditer(text):
        arguments = split_arguments(_balanced_args(text, call.end() - 1))
        if len(arguments) < 2:
            continue
        threads, min_blocks = (evaluate_int(argument, constants) for argument in arguments[:2])
        if min_blocks == 1 or (threads is not None and threads >= 256 and min_blocks is not None):
            continue
        waves = f"{min_blocks} waves per EU" if min_blocks is not None else "that many waves per EU"
        yield Hit(*_position(text, call.start()), f"HIP asks for {waves}" +
                  (f", {min_blocks * 4 * 64} threads per CU, against CUDA's {min_blocks * threads} per SM"
                   if threads is not None and min_blocks is not None else ""))


# ---- shuffle loops over 32 lanes ----------------------------------------------------------------

_SHUFFLE = re.compile(r"__shfl|__reduce_\w+_sync|shfl_(?:xor|down|up)")
_LANE_LOOP = re.compile(r"\bfor\s*\([^;]*=\s*16[uU]?\s*;|\bfor\s*\([^;]*;[^;]*<=?\s*(?:32|31)[uU]?\s*;")
_FIXED_TILE = re.compile(r"\bthread_block_tile\s*<[^<>]+>\s+(\w+)|\b(\w+)\s*=\s*(?:\w+::)*tiled_partition\s*<[^<>]+>\s*\(")


def _explicit_width_shuffles(text: str, constants: dict[str, str]) -> str:
    """`text` with the names of the shuffle calls that give a width of at most 32 lanes
    (`__shfl_xor_sync(m, v, o, 32)`, `__shfl_down(v, o, 16)`) blanked out, offsets kept: each such call works
    on its own group of that many lanes, on a 64-lane wavefront too."""
    for call in reversed(list(re.finditer(r"\b__shfl(_up|_down|_xor)?(_sync)?\s*\(", text))):
        arguments = split_arguments(_balanced_args(text, call.end() - 1))
        width_at = 2 + bool(call.group(2))  # (mask,) var, lane or offset, width
        width = evaluate_int(arguments[width_at], constants) if len(arguments) > width_at else None
        if width is not None and width <= 32:
            text = text[: call.start()] + "_" * (len(call.group(0)) - 1) + text[call.end() - 1 :]
    return text


def check_lane_loops(text: str) -> Iterable[Hit]:
    """Flag a loop starting at 16 or running to 32 with a shuffle in its body or within 3 lines below, except
    shuffles of a cooperative-groups tile of fixed size (`thread_block_tile<32> g`) and shuffles that name
    their width (`__shfl_xor_sync(m, v, o, 32)`): the loop then covers the tile or the width, whose size
    `warp-tile-32` / `warp-size-define` flag where it is written."""
    tiles = {match.group(1) or match.group(2) for match in _FIXED_TILE.finditer(text)}
    tile_shuffle = re.compile(rf"\b(?:{'|'.join(tiles)})\s*(?:\.|->)\s*shfl\w*") if tiles else None
    searched = _explicit_width_shuffles(text, source_constants(text))
    lines = searched.splitlines()
    starts = _line_starts(lines)
    for index, line in enumerate(lines):
        loop = _LANE_LOOP.search(line)
        if loop is None:
            continue
        header = starts[index] + loop.start() + searched[starts[index] + loop.start() :].find("(")
        body_start = header + len(_balanced_args(searched, header)) + 2
        nearby = "\n".join([searched[body_start : _statement_end(searched, body_start)], *lines[index : index + 4]])
        if _SHUFFLE.search(tile_shuffle.sub("", nearby) if tile_shuffle else nearby):
            yield Hit(index + 1, loop.start() + 1)


# ---- warp size 32: written as a warp-size constant, or under another name where a warp width goes --

_WARP_SIZE_NAME = r"\w*(?i:warp_?(?:size|threads|lanes|width)|warpsz|threads_?per_?warp|lanes?_?per_?warp)\w*"
_WARP_SIZE_DEFINE = re.compile(rf"^\s*#\s*define\s+{_WARP_SIZE_NAME}\s+\(?(32|64)[uU]?\)?\s*$"
                               rf"|\b{_WARP_SIZE_NAME}\s*=\s*(32|64)[uU]?\b"
                               rf"|\b{_WARP_SIZE_NAME}\s*\(\s*\)\s*(?:const\s*)?(?:noexcept\s*)?\{{\s*return\s+(32|64)[uU]?\s*;",
                               re.MULTILINE)  # `#define WARP_SIZE 32`, `kWarpSize = 32u`, `int warp_size() { return 32; }`


def _warp_width_use(name: str, text: str) -> int | None:
    """Offset of the first place `name` is used as a warp width: the width argument of a shuffle
    (`__shfl_xor_sync(m, v, 1, NAME)`) or `% NAME` / `/ NAME` on a thread, lane or warp index in a function that
    works across a warp."""
    for use in re.finditer(rf"__shfl\w*\s*\((?:[^()]|\([^()]*\))*,\s*({name})\s*\)|[%/]\s*({name})\b", text):
        line_start = text.rfind("\n", 0, use.start()) + 1
        if use.group(1) or (_LANE_NAMES.search(_left_operand(text[line_start : use.start()], use.start() - line_start))
                            and not in_lane_blind_function(text, use.start())):
            return use.start()
    return None


def _closing_angle(text: str, open_angle: int) -> int | None:
    """Index of the `>` closing the template argument list that opens at `open_angle`, or None if unclosed."""
    depth = 0
    for index in range(open_angle, min(len(text), open_angle + 2000)):
        depth += {"<": 1, "(": 1, ">": -1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return index
    return None


def _template_arguments(text: str, open_angle: int) -> list[str] | None:
    """The top-level arguments of the template argument list opening at `open_angle`, or None if unclosed."""
    close = _closing_angle(text, open_angle)
    return split_arguments(text[open_angle + 1 : close]) if close is not None else None


_DECLARED_NAME = re.compile(r"\b(?:struct|class)\s+(\w+)|(\w+)\s*\(")


def _default_never_used(text: str, offset: int) -> bool:
    """Whether `offset` is in a template parameter's default (`template <int W, int WARP_SIZE = 32>`) that no use
    of the template in this file falls back on: each `name<...>` it finds passes that parameter explicitly."""
    head = next((h for h in _TEMPLATE_HEAD.finditer(text, max(0, offset - 2000)) if h.start(1) <= offset < h.end(1)), None)
    if head is None:
        return False
    position = offset - head.start(1)
    index = len(split_arguments(head.group(1)[:position])) - 1
    after = text[head.end() : head.end() + 400]
    declared = next((name for match in _DECLARED_NAME.finditer(after) if (name := match.group(1) or match.group(2)) not in _ATTRIBUTES), None)
    if declared is None:
        return False
    uses = [_template_arguments(text, use.end() - 1) for use in re.finditer(rf"\b{re.escape(declared)}\s*<", text)]
    return bool(uses) and all(arguments is not None and len(arguments) > index for arguments in uses)


_WAVEFRONT_WIDE = re.compile(r"\b__(?:ballot|activemask|any|all|match_\w+|reduce_\w+)(?:_sync)?\s*\(|\bwarpSize\b")


_TILE_SIZE = re.compile(r"\b(?:tiled_partition|thread_block_tile)\s*<\s*(\d+)\s*>")
_TILE_VOTE = re.compile(r"(?:\.|->)\s*(?:ballot|any|all|match_any|match_all)\s*\(")


@functools.lru_cache(maxsize=4)  # three rules ask it of one file
def _logical_32_lane_groups(text: str) -> bool:
    """Whether the file's warp-level code works in 32-lane groups that a 64-lane wavefront holds two of: it
    shuffles, every shuffle names a width of at most 32 or goes through a cooperative-groups tile of at most 32
    (`tiled_partition<32>(block)`, whose shuffles stay in the tile), and nothing spans the whole wavefront (a
    ballot or other vote, a tile's included, `warpSize`)."""
    shuffles = re.findall(r"\b__shfl\w*\s*\(", text)
    tiles = [int(size) for size in _TILE_SIZE.findall(text)]
    narrowed = _explicit_width_shuffles(text, source_constants(text))
    return (bool(shuffles or tiles) and all(size <= 32 for size in tiles) and not re.search(r"\b__shfl\w*\s*\(", narrowed)
            and not _WAVEFRONT_WIDE.search(text) and not _TILE_VOTE.search(text))


def check_warp_tiles(text: str) -> Iterable[Hit]:
    """Flag a cooperative-groups tile of 32, unless the file's warp-level code all stays in 32-lane groups
    (`_logical_32_lane_groups`): then the tile is a grouping choice a 64-lane wavefront holds two of."""
    if _logical_32_lane_groups(text):
        return []
    return pattern_hits(_TILE_OF_32, text.split("\n"))


_TILE_OF_32 = re.compile(r"\b(?:tiled_partition|thread_block_tile)\s*<\s*32\s*>")


def check_warp_size_definitions(text: str) -> Iterable[Hit]:
    """Flag a warp-size constant set to 32 (`#define WARP_SIZE 32`, `kWarpSize = 32`) or, in code hipcc compiles
    (an AMD branch), to 64, which is CDNA's wavefront but not RDNA's; and a constant of 32 under another name
    (`#define ROW_THREADS 32`) that the file uses as a warp width. Left alone: a template parameter's default that
    every use of the template overrides, and a 32 in a file whose warp-level code keeps to 32-lane groups
    (`_logical_32_lane_groups`: a logical warp, right on a 64-lane wavefront too)."""
    logical = _logical_32_lane_groups(text)
    for match in _WARP_SIZE_DEFINE.finditer(text):
        if _default_never_used(text, match.start()) or (logical and "64" not in match.groups()):
            continue
        detail = ("64 is CDNA's wavefront size; RDNA GPUs (gfx11, RX 7900 XTX) run 32-lane waves: use warpSize or "
                  "__AMDGCN_WAVEFRONT_SIZE" if "64" in match.groups() else "")
        yield Hit(*_position(text, match.start() + len(match.group(0)) - len(match.group(0).lstrip())), detail)
    constants = source_constants(text)
    for name, expr in constants.items():
        if re.fullmatch(_WARP_SIZE_NAME, name) or evaluate_int(expr, constants) != 32:
            continue
        use = _warp_width_use(re.escape(name), text)
        definition = re.search(rf"^[ \t]*#[ \t]*define[ \t]+{re.escape(name)}\b|\b{re.escape(name)}\s*=", text, re.MULTILINE)
        if use is not None and definition is not None:
            line, _ = _position(text, use)
            yield Hit(*_position(text, definition.start() + len(definition.group(0)) - len(definition.group(0).lstrip())),
                      f"`{name}` is used as a warp width on line {line}")
    if not logical:
        yield from _warp_size_squared(text, constants)


# a warp-size constant, namespace-qualified or not (`cuda::warp_size`, `WARP_SIZE`, `kWarpSize`): often one another
# header defines, 32 for CUDA and the wavefront's 64 in its HIP twin
_QUALIFIED_WARP_SIZE = rf"(?:\w+\s*::\s*)*{_WARP_SIZE_NAME}"
_SQUARE_BLOCK = re.compile(rf"\bdim3\s*(?:\w+\s*)?[({{]\s*({_QUALIFIED_WARP_SIZE})\s*,\s*({_QUALIFIED_WARP_SIZE})\s*[,)}}]")
_ROW_LOOP = re.compile(rf"\bfor\s*\(\s*(?:[\w:]+\s+)*(\w+)\s*=\s*threadIdx\s*\.\s*[yz]\s*;[^;]*;\s*\1\s*\+=\s*"
                       rf"\(?\s*({_QUALIFIED_WARP_SIZE})\s*(?:/\s*(\d+)[uU]?\s*)?\)?\s*\)")
_WIDE = 64  # the wavefront a warp-size constant becomes on CDNA
_BLOCK_LIMIT = 1024  # threads in a block, NVIDIA's and AMD's limit alike


def _warp_size_value(name: str, constants: dict[str, str]) -> int | None:
    """What a (qualified) warp-size name holds where this file says (`constexpr int kWarpSize = 32;`), or None when
    another header defines it."""
    bare = re.sub(r"\s", "", name).split("::")[-1]
    return evaluate_int(constants[bare], constants) if bare in constants else None


def _at_wavefront(expr: str, constants: dict[str, str]) -> int | None:
    """`expr` evaluated with each warp-size name in it taken as a wavefront of 64."""
    return evaluate_int(re.sub(_QUALIFIED_WARP_SIZE, str(_WIDE), expr), constants)


def _warp_size_squared(text: str, constants: dict[str, str]) -> Iterable[Hit]:
    """Uses of a warp-size constant that hold only while it is 32: a block shape of it by it (`dim3 threads(warp_size,
    warp_size)`: 1024 threads at 32, 4096 at 64), a `__shared__` array with two dimensions of it whose bytes at 64
    pass the LDS (`[warp_size][warp_size][8]` ints: 32 KiB at 32, 128 KiB at 64), and a loop over the block's rows
    from `threadIdx.y` stepping by it or half of it in a kernel the file launches with rows of it (`dim3(warp_size,
    rows)`): it needs warp_size x warp_size / 2 threads, 2048 at 64, so a block that fits has fewer rows than the
    step and rows are skipped. A name the file sets to neither 32 nor 64 (a logical width of 16) is left alone."""

    def wavefront_sized(*names: str) -> bool:
        return all(_warp_size_value(name, constants) in (None, 32, _WIDE) for name in names)

    for block in _SQUARE_BLOCK.finditer(text):
        if wavefront_sized(block.group(1), block.group(2)):
            yield Hit(*_position(text, block.start()),
                      f"`{block.group(1)}` x `{block.group(2)}` threads: 1024 with 32-lane warps, "
                      f"{_WIDE * _WIDE} (over the {_BLOCK_LIMIT}-thread limit) with 64-lane wavefronts: give the "
                      "second dimension the warps per block (`max_threads / warp_size`)")
    for array in _STATIC_SHARED.finditer(text):
        dims = [dim.strip() for dim in re.findall(r"\[([^\]]+)\]", array.group(2))]
        squared = [dim for dim in dims if re.fullmatch(_QUALIFIED_WARP_SIZE, dim)]
        if len(squared) < 2 or not wavefront_sized(*squared):
            continue
        size = _at_wavefront("*".join([f"sizeof({array.group(1)})", *(f"({dim})" for dim in dims)]), constants)
        if size is not None and size > LDS_LIMIT_BYTES:
            yield Hit(*_position(text, array.start()),
                      f"{len(squared)} dimensions of `{squared[0]}`: {size // 2 ** len(squared) // 1024:g} KiB with 32-lane warps, "
                      f"{size // 1024:g} KiB (over the 64 KiB of LDS) with 64-lane wavefronts: size the row "
                      "dimension by the warps per block")
    row_loops = list(_ROW_LOOP.finditer(text))
    launches: dict[str, list[str]] = {}  # kernel -> the first block dimension of each launch (read where rows loop)
    for launch in _KERNEL_LAUNCH.finditer(text) if row_loops else ():
        arguments = split_arguments(launch.group(2))
        if len(arguments) < 2:
            continue
        block = arguments[1].strip()
        launcher = getattr(enclosing_function(text, launch.start()), "body_start", 0)
        named = re.compile(rf"\bdim3\s+{re.escape(block)}\s*[({{]\s*([^,)}}]+)").search(text, launcher, launch.start())
        inline = re.match(r"dim3\s*[({]\s*([^,)}]+)", block)
        if (found := named or inline) is not None:
            launches.setdefault(launch.group(1), []).append(found.group(1).strip())
    for loop in row_loops:
        step, divisor = loop.group(2), int(loop.group(3) or 1)
        kernel = enclosing_function(text, loop.start())
        if (kernel is None or not kernel.device or divisor > 2 or not wavefront_sized(step)
                or not any(re.fullmatch(_QUALIFIED_WARP_SIZE, x) for x in launches.get(kernel.name, ()))):
            continue
        yield Hit(*_position(text, loop.start()),
                  f"rows of `{step}` threads stepped by `{loop.group(0).split('+=')[1].strip(' )')}`: the loop assumes "
                  f"blockDim.y = {step}{f' / {divisor}' if divisor > 1 else ''}, a block of {_WIDE * _WIDE // divisor} "
                  "threads with 64-lane wavefronts; a block that fits has fewer rows and these rows are skipped: "
                  "step by blockDim.y")


# ---- __CUDA_ARCH__ tests that compile code out on AMD ---------------------------------------------

_OLD_ARCH_TEST = re.compile(rf"\b{CUDA_ARCH_NAME}\s*<")
_ARCH_TEST = re.compile(rf"\b{CUDA_ARCH_NAME}\s*(?:[<>]=?|==|!=)|defined\s*\(?\s*{CUDA_ARCH_NAME}\b")


# A condition naming one of these is a port already made (`__HIP_DEVICE_COMPILE__`: hipcc's device pass; the hcc-era
# `__HIP_PLATFORM_HCC__` beside a current one too, but alone it is compiler-guard's).
_AMD_MACRO = re.compile(rf"\b(?:{'|'.join(sorted(DEFINED_ON_AMD | {'__HIP_DEVICE_COMPILE__'}))})\b")


# A branch that only traps: `assert(false);`, `__trap();`, llama.cpp's `NO_DEVICE_CODE;` (nothing lost without it).
_STUB = re.compile(r"(?:\s*(?:assert\s*\(\s*(?:false|0)\s*\)|__trap\s*\(\s*\)|__builtin_(?:trap|unreachable)\s*\(\s*\)"
                   r"|NO_DEVICE_CODE)\s*;?)*\s*")

# A branch that only describes or vets the compiler: streams its name and version macros into a string
# (`out << "nvcc " << __CUDACC_VER_MAJOR__;`) or stops an unsupported release (`#error`), its directives around them;
# AMD loses only a line of a build banner or a check meant for nvcc.
_COMPILER_REPORT = re.compile(r"(?:\s*(?:#[ \t]*(?:if|ifdef|ifndef|elif|else|endif|error)\b[^\n]*"
                              r"|\w+(?:\s*<<\s*(?:\"(?:\\.|[^\"\\\n])*\"|__\w+__))+\s*;))*\s*")

# A branch that only synchronises the block or the warp (`__syncthreads();`, a cooperative group's `b.sync();`).
_BARRIER = re.compile(r"(?:\s*(?:__syncthreads|__syncwarp|\w+\.sync)\s*\(\s*\)\s*;)+\s*")


def _branch_body(text: str, opening, following) -> str:
    """The lines between directive `opening` and the next directive of its group."""
    return "\n".join(text.split("\n")[opening.last + 1 : following.first])


def _directive_hit(text: str, directive, detail: str) -> Hit:
    """A finding on the `#` of `directive`'s first line."""
    line = text.split("\n")[directive.first]
    return Hit(directive.first + 1, len(line) - len(line.lstrip()) + 1, detail)


def _guards_compiling_out(text: str, test: re.Pattern, true_alone: re.Pattern | None = None, skip=None) -> Iterable[Hit]:
    """Each `#if` / `#elif` whose condition matches `test` where hipcc compiles a branch of its group out because
    of it: its own (a false test) or, when it is true on AMD, the `#elif` / `#else` after it. A true test with
    nothing after it only keeps its code, which is then compiled on AMD: flagged only when its condition matches
    `true_alone` (a branch meant for another compiler, or for old NVIDIA GPUs, taken). A condition that also names an AMD macro
    (`defined(__NVCC__) || defined(__HIPCC__)`) is a port already made; a group where AMD loses only a trap
    (`#if __CUDA_ARCH__ < 800` / `assert(false);` / `#else` the real code) costs nothing. `text` keeps the
    branches hipcc compiles out (`Rule.reads_dead_code`). `skip(directive, found)` leaves more directives alone."""
    found = directives(text)
    for directive in found:
        if (directive.kind in ("else", "endif") or directive.enclosed_dead or not test.search(directive.condition)
                or _AMD_MACRO.search(directive.condition) or (skip is not None and skip(directive, found))):
            continue
        value = on_amd(directive.condition)
        later = [d for d in found if d.group == directive.group and d.first > directive.first and d.kind != "endif"]
        closing = [d for d in found if d.group == directive.group and d.first > directive.first]
        dropped = ([_branch_body(text, directive, closing[0])] if value is False and closing else
                   [_branch_body(text, d, n) for d, n in zip(later, closing[1:])] if value is True else [])
        if dropped and all(_STUB.fullmatch(body) or _COMPILER_REPORT.fullmatch(body) for body in dropped):
            continue  # AMD loses only a trap (`assert(false)` for old GPUs) or a compiler's banner, and compiles the real code
        if value is True and not later and closing and _BARRIER.fullmatch(_branch_body(text, directive, closing[0])):
            continue  # AMD gains only a barrier (`#if __CUDA_ARCH__ < 700` / `__syncthreads();`): the safe choice
        if value is not True or later or (true_alone is not None and true_alone.search(directive.condition)):
            yield _directive_hit(text, directive,
                      "the branch it opens is compiled out on AMD" if value is False
                      else f"the branch on line {later[0].first + 1} is compiled out on AMD" if value is True and later
                      else "the branch it opens is taken on AMD" if value is True else "")


_ARCH_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+(.*\b__CUDA_ARCH__\b.*)$", re.MULTILINE)


def _arch_defines(text: str) -> Iterable[Hit]:
    """A `#define NAME (__CUDA_ARCH__ >= X)` outside code AMD compiles out: a constant on AMD (X another of the
    file's macros is read through it), so every `#if NAME` elsewhere picks its branch blind."""
    dead, constants = set(dead_lines(text)), source_constants(text)

    def known(name: re.Match) -> str:
        value = None if name.group(0) == "__CUDA_ARCH__" else evaluate_int(name.group(0), constants)
        return name.group(0) if value is None else str(value)

    for match in _ARCH_DEFINE.finditer(text):
        line, column = _position(text, match.start(1))
        value = on_amd(_NAME.sub(known, match.group(2)).strip()) if line - 1 not in dead else None
        if value is not None:
            yield Hit(line, column, f"`{match.group(1)}` is {'true' if value else 'false'} on AMD: hipcc leaves "
                                    "`__CUDA_ARCH__` undefined")


_HOST_ONLY_BRANCH = re.compile(r"!\s*defined\s*\(?\s*" + CUDA_ARCH_NAME + r"\b")


# special members a class declares: a destructor, a copy (or move) constructor, an assignment operator
_SPECIAL_MEMBER = re.compile(r"~\s*\w+\s*\(|\boperator\s*=\s*\(|\b(\w+)\s*\(\s*(?:const\s+)?\1\s*&")


def _host_branches_in_device_code(text: str) -> Iterable[Hit]:
    """`#ifndef __CUDA_ARCH__` (nvcc's host pass only) with no `#else`, where hip-clang's device pass, which defines
    no `__CUDA_ARCH__`, compiles it too: in a `__host__ __device__` function (a `throw`, host-only calls in device
    code), or at class scope declaring special members that nvcc's device pass never sees (sppark's host-only copy
    constructor and destructor: the device pass of a file with device code sees them on AMD)."""
    found = directives(text)
    starts = _line_starts(text.split("\n"))
    device_code = re.search(r"\b__(?:device|global)__\b", text)
    for directive in found:
        if directive.kind not in ("if", "ifndef") or not _HOST_ONLY_BRANCH.search(directive.condition):
            continue
        closing = [d for d in found if d.group == directive.group and d.first > directive.first]
        if not closing or closing[0].kind != "endif":  # an #else: flagged above
            continue
        body = _branch_body(text, directive, closing[0])
        function = enclosing_function(text, starts[directive.first])
        if function is not None and function.device and body.strip():
            yield _directive_hit(text, directive, "its host-only branch is compiled by HIP's device pass too"
                                 + (", and throws" if re.search(r"\bthrow\b", body) else ""))
        elif function is None and device_code and _SPECIAL_MEMBER.search(body):
            yield _directive_hit(text, directive, "HIP's device pass sees the host-only special members it hides "
                                 "from nvcc's: the class is no longer trivially copyable in device code")


_REGISTER = re.compile(r"(?:^|[;{}(,])\s*register\s+(?=[A-Za-z_])")


def check_register_storage(text: str, build: Build) -> Iterable[Hit]:
    """Flag the `register` storage class where the HIP build compiles C++17 or later (hipcc's default), where clang
    rejects it; an older `-std` only warns."""
    return pattern_hits(_REGISTER, text.splitlines()) if build.std >= 17 else []


def check_arch_guards(text: str, build: Build) -> Iterable[Hit]:
    """Flag an `#if` / `#elif` that tests `__CUDA_ARCH__` (a comparison, or `#ifdef`) where hipcc compiles a
    branch of its group out because of it (`>= 800` and `defined(__CUDA_ARCH__)` are false on AMD, `< 700` true),
    and a macro defined as such a test (`#define HAS_BF16 (__CUDA_ARCH__ >= 800)`), which is a constant on AMD. A
    test for GPUs older than sm_N (`#if __CUDA_ARCH__ < 600`) is true on AMD: its branch (a CAS-loop `atomicAdd`
    for doubles, a no-op `atomicAdd` macro for sm_1x) is compiled there even with nothing after it; so is the host
    branch of a `__host__ __device__` function (`#ifndef __CUDA_ARCH__`), flagged where it throws. Nothing where the
    HIP build defines `__CUDA_ARCH__` itself (`-D__CUDA_ARCH__=600`, as Legion's first HIP build did): it has chosen
    what AMD compiles."""
    if "__CUDA_ARCH__" in build.defined:
        return []
    return sorted([*_guards_compiling_out(text, _ARCH_TEST, true_alone=_OLD_ARCH_TEST), *_arch_defines(text),
                   *_host_branches_in_device_code(text)], key=lambda hit: (hit.line, hit.column))


def check_compiler_guards(text: str) -> Iterable[Hit]:
    """Flag an `#if` / `#elif` testing `__NVCC__` or whether nvcc's `__CUDACC_VER_MAJOR__` is defined (nvcc's own
    macros: hipcc never defines them), the GCC version
    (hipcc's clang says 4) or the CUDA toolkit's version (undefined under hipcc; torch's hipify makes `CUDA_VERSION`
    TORCH_HIP_VERSION, about 600) where hipcc compiles a branch of its group out because of it: a `#if CUDART_VERSION
    >= 12000` around a whole fp8 section builds its stubs on AMD, a `#if CUDA_VERSION < 8000` / `#error` stops the build;
    `__HIP_PLATFORM_HCC__` alone (the hcc-era platform macro ROCm 6.0 no longer defines): its AMD branch is lost; and
    `__CUDA_BF16_TYPES_EXIST__` / `__CUDA_FP8_TYPES_EXIST__`, which only CUDA's headers define: the bf16 code is lost."""
    def old_nvcc_workaround(directive, found) -> bool:
        """`#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ < 12`: a fix for old nvcc releases only, which
        hipcc rightly compiles out (its `#else` is the general code)."""
        return bool(_OLD_NVCC.search(directive.condition)) and not _NEWER_NVCC.search(directive.condition)

    nvcc = list(_guards_compiling_out(text, _NVCC_TEST, skip=old_nvcc_workaround))
    # an old-compiler or old-toolkit escape (`#if __GNUC__ < 6`, `#if CUDA_VERSION < 8000` / `#error`) is the trap
    # when hipcc takes it, even with nothing after it
    gcc = list(_guards_compiling_out(text, _GCC_VERSION_TEST, true_alone=_GCC_VERSION_TEST))
    # a CUDA-version test hipcc answers (a `__CUDA_ARCH__` test in it is cuda-arch-guard's), except the one choice
    # that goes AMD's way: `*_sync` warp functions for CUDA >= 9 with an `#else` of the legacy ones HIP has
    def undecided(directive, found) -> bool:
        return (bool(_ARCH_TEST.search(directive.condition)) or on_amd(directive.condition) is None
                or _legacy_warp_fallback(text, directive, found) or old_nvcc_workaround(directive, found))

    cuda = list(_guards_compiling_out(text, _CUDA_VERSION_TEST, true_alone=_CUDA_VERSION_TEST, skip=undecided))
    # an AMD branch of the hcc era is compiled out from ROCm 6.0, and an `#ifndef __HIP_PLATFORM_HCC__` branch meant
    # for CUDA alone is taken
    hcc = list(_guards_compiling_out(text, _HCC_TEST, true_alone=_HCC_TEST))
    # `#ifdef __CUDA_BF16_TYPES_EXIST__`: a feature HIP has, tested by a macro only CUDA's header defines
    feature = list(_guards_compiling_out(text, _CUDA_FEATURE_TEST))
    return sorted({hit.line: hit for hit in cuda + gcc + nvcc + hcc + feature}.values(), key=lambda hit: hit.line)



_CUDA_VERSION_NAME = re.compile(r"\b(?:__CUDACC_VER_(?:MAJOR|MINOR|BUILD)__|CUDART_VERSION)\b")


def _lines_outside(text: str, directive: re.Pattern) -> Iterable[tuple[int, str]]:
    """(1-based number, line) of each line of `text` outside the preprocessor directives `directive` matches at their
    start, their backslash-continued lines included."""
    continued = False
    for number, line in enumerate(text.split("\n"), start=1):
        inside = continued or bool(directive.match(line))
        continued = inside and line.rstrip().endswith("\\")
        if not inside:
            yield number, line


def check_cuda_version_expressions(text: str) -> Iterable[Hit]:
    """Flag C++ code, not a preprocessor directive, that reads nvcc's version macros or `CUDART_VERSION`
    (`static_assert(__CUDACC_VER_MAJOR__ > 10, ...)`, `return CUDART_VERSION;`): in a directive an undefined name is 0,
    in code hipcc finds no such identifier."""
    for number, line in _lines_outside(text, re.compile(r"\s*#")):
        match = _CUDA_VERSION_NAME.search(line)
        if match and line.count('"', 0, match.start()) % 2 == 0:  # not inside a string literal
            yield Hit(number, match.start() + 1, f"`{match.group(0)}` is undefined under hipcc")

# A project's build flag naming CUDA (`WITH_CUDA`, `BUILD_CUDA`, `GOOGLE_CUDA`) or cuDNN (Caffe's `USE_CUDNN`), not
# the toolkits' own version macros, or one for a CUDA library or type (autoconf's `HAVE_CUFFT_H`,
# `SIZEOF_CUFLOATCOMPLEX`: AC_CHECK_SIZEOF(cuFloatComplex), which only the CUDA configure runs; ELPA's `WITH_CUCUB`)
_CUDA_BUILD_FLAG = re.compile(r"\b(?!__CUDA|CUDA_VERSION\b|CUDART_VERSION\b|CUDNN_VERSION\b)(\w*CU(?:DA|DNN)\w*"
                              r"|(?:HAVE|SIZEOF|WITH|USE|ENABLE)_(?:CU(?:BLAS|FFT|RAND|SPARSE|SOLVER|COMPLEX|FLOATCOMPLEX"
                              r"|DOUBLECOMPLEX|CUB)|CUB)\w*)\b")
_OPT_OUT_FLAG = re.compile(r"(?:^|_)(?:NO|DISABLE|DISABLED|SKIP|WITHOUT)(?:_|$)")
# a build flag's branch holding this share of a file's lines of code (not blank, not a preprocessor line) guards the
# whole file: the port widens it
WHOLE_FILE = 0.8


@dataclass(frozen=True)
class FlagBranch:
    """A conditional directive whose branch a CUDA build flag compiles out on AMD: the flags, and whether the branch
    holds the whole file (WHOLE_FILE of its code)."""

    directive: Directive
    flags: list[str]
    whole_file: bool


def build_flags_compiling_out(text: str, build: Build) -> Iterable[FlagBranch]:
    """Each `#if` / `#ifdef` / `#elif` that compiles its branch out on AMD because it tests project build flags
    naming CUDA or cuDNN that the HIP build leaves undefined (`-U WITH_CUDA`), unless an `#elif` after it tests an
    AMD flag."""
    found = directives(text, build)
    lines = text.split("\n")
    code_lines = [index for index, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    for directive in found:
        if (directive.kind in ("else", "endif") or directive.enclosed_dead
                or on_amd(directive.condition, build) is not False or _amd_branch_follows(directive, found)):
            continue
        flags = sorted(flag for flag in set(_CUDA_BUILD_FLAG.findall(directive.condition)) & build.undefined
                       if not _OPT_OUT_FLAG.search(flag))  # `GGML_CUDA_NO_VMM`: its branch is the fallback
        if flags:
            end = next((d.first for d in found if d.group == directive.group and d.first > directive.first), len(lines))
            held = sum(directive.last < index < end for index in code_lines)
            yield FlagBranch(directive, flags, held >= WHOLE_FILE * len(code_lines))


_AMD_FLAG = re.compile(r"\b\w*(?:HIP|ROCM|HCC)\w*\b")


def _amd_branch_follows(directive, found) -> bool:
    """Whether an `#elif` after `directive` in its group tests an AMD flag (`#elif defined(HAVE_HIPBLAS)`): the project
    has its AMD branch already."""
    return any(d.group == directive.group and d.first > directive.first and d.kind == "elif"
               and _AMD_FLAG.search(d.condition) for d in found)


def check_cuda_build_flags(text: str, build: Build) -> Iterable[Hit]:
    """Flag a directive that compiles GPU code out on AMD through a CUDA build flag the HIP build leaves undefined
    (`build_flags_compiling_out`): the GPU code under it is lost on AMD. A cuDNN flag only around the whole file (a
    cuDNN layer): a smaller cuDNN branch sits beside its fallback (darknet's im2col convolution), which AMD takes."""
    for branch in build_flags_compiling_out(text, build):
        if branch.whole_file or any("CUDA" in flag or "CUDNN" not in flag for flag in branch.flags):
            yield _directive_hit(text, branch.directive,
                                 f"the HIP build leaves `{branch.flags[0]}` undefined: the branch is compiled out")


_SYNC_WARP_CALL = re.compile(r"\b__(?:shfl(?:_up|_down|_xor)?|ballot|any|all)_sync\s*\(")
_LEGACY_WARP_CALL = re.compile(r"\b__(?:shfl(?:_up|_down|_xor)?|ballot|any|all)\s*\(")


def _legacy_warp_fallback(text: str, directive, found) -> bool:
    """Whether `directive`'s branch calls `*_sync` warp functions and the next branch of its group the legacy ones."""
    following = [d for d in found if d.group == directive.group and d.first > directive.first]
    if len(following) < 2 or following[0].kind == "endif":
        return False
    return bool(_SYNC_WARP_CALL.search(_branch_body(text, directive, following[0]))
                and _LEGACY_WARP_CALL.search(_branch_body(text, following[0], following[1])))


# nvcc's own macros: `__NVCC__`, and its version macros tested for being defined (a comparison is a CUDA-version test)
_NVCC_TEST = re.compile(r"\b__NVCC__\b|\bdefined\s*\(?\s*__CUDACC_VER_(?:MAJOR|MINOR|BUILD)__\b")
_HCC_TEST = re.compile(r"\b__HIP_PLATFORM_HCC__\b")
_OLD_NVCC = re.compile(r"\b__CUDACC_VER_\w+__\s*<")
_NEWER_NVCC = re.compile(r"\b__CUDACC_VER_\w+__\s*>")
_CUDA_FEATURE_TEST = re.compile(r"\b__CUDA_(?:BF16|FP8)_TYPES_EXIST__\b")
_GCC_VERSION_TEST = re.compile(r"\b__GNUC__\s*(?:[<>]=?|==|!=)")
_CUDA_VERSION_TEST = re.compile(r"\b(?:CUDA_VERSION|CUDART_VERSION|__CUDACC_VER_MAJOR__)\s*(?:[-+]\s*0\s*\)\s*)?"
                                r"(?:[<>]=?|==|!=)")


# ---- host-side C++ that clang rejects, and runtime APIs HIP answers differently --------------------

def check_void_pointer_arithmetic(text: str) -> Iterable[Hit]:
    """Flag `p + n`, `p - n`, `p += n` in a function where `p` is declared `void*` (a parameter or a local),
    unless cast first (`(char*)p + n`); and `+`, `-`, `%` on a variable declared `CUdeviceptr` anywhere in the file
    (a member too), which HIP's driver API declares `void*`."""
    for function in functions(text):
        scope = function_scope(text, function)
        for name in set(re.findall(r"\bvoid\s*\*\s*(?:const\s+)?(\w+)\s*[=;,)]", scope)):
            if re.search(rf"\b(?!void\b)\w+\s*\*\s*(?:const\s+)?{name}\s*[=;,)]", scope):
                continue  # the name also holds a typed pointer in a scope of its own
            for use in re.compile(rf"\b{name}\s*(?:[+-](?![-+>=])|[+-]=)").finditer(text, function.body_start, function.body_end):
                before = text[function.body_start : use.start()].rstrip()
                if not before.endswith((")", ".", ">", "*", "&")):
                    yield Hit(*_position(text, use.start()), f"`{name}` is a `void*` in `{function.name}`")
    # the driver API's device address: an integer in CUDA, `hipDeviceptr_t` (a `void*`) once translated
    for name in set(re.findall(r"\bCUdeviceptr\s+(\w+)\s*[=;,){]", text)):
        for use in re.finditer(rf"(?<![.>\w])\b{name}\s*(?:[+%-](?![-+>=])|[+-]=)", text):
            if not text[: use.start()].rstrip().endswith(")"):
                yield Hit(*_position(text, use.start()), f"`{name}` is a CUdeviceptr: `hipDeviceptr_t`, a `void*`, on AMD")


def check_capture_info_arity(text: str) -> Iterable[Hit]:
    """Flag `cudaStreamGetCaptureInfo(...)` with more than three arguments (CUDA 12's form)."""
    for call in re.finditer(r"\bcudaStreamGetCaptureInfo\s*\(", text):
        if len(split_arguments(_balanced_args(text, call.end() - 1))) > 3:
            yield Hit(*_position(text, call.start()))



# CUDA runtime calls whose C++ overload or default argument (cuda_runtime.h, cuda_runtime_api.h) HIP's namesake lacks:
# the name, the number of arguments that does not compile on HIP, what HIP takes instead
_RUNTIME_OVERLOADS = {
    "cudaEventCreate": (2, "`hipEventCreate` takes the event alone: flags go to `hipEventCreateWithFlags`"),
    "cudaStreamWaitEvent": (2, "ROCm 6.0's `hipStreamWaitEvent` declares its flags without a default (6.1 gives "
                               "them 0): pass 0"),
}
_RUNTIME_OVERLOAD_CALL = re.compile(rf"\b({'|'.join(_RUNTIME_OVERLOADS)})\s*\(")


def check_runtime_overloads(text: str) -> Iterable[Hit]:
    """Flag a call of `_RUNTIME_OVERLOADS` with the number of arguments HIP's namesake does not take."""
    for call in _RUNTIME_OVERLOAD_CALL.finditer(text):
        arity, hip = _RUNTIME_OVERLOADS[call.group(1)]
        if len(split_arguments(_balanced_args(text, call.end() - 1))) == arity:
            yield Hit(*_position(text, call.start()), hip)


_CUTLASS_INCLUDE = re.compile(r"#\s*include\s*[<\"](?:cutlass|cute)/")
_CUTLASS_NAME = re.compile(r"(?<![\w:])(?:cutlass|cute)::")


_CUDNN_USE = re.compile(r"#\s*include\s*[<\"]cudnn\.h[>\"]|\bcudnn[A-Z]\w*\s*\(")


def check_cudnn(text: str) -> Iterable[Hit]:
    """Flag `#include <cudnn.h>` and each line calling a `cudnn*` function, not in a `#define`'s body (a checking macro
    such as `CUDNN_CHECK` is flagged where it is used, on its cuDNN call)."""
    for number, line in _lines_outside(text, re.compile(r"\s*#\s*define\b")):
        if match := _CUDNN_USE.search(line):
            yield Hit(number, match.start() + 1)


def check_cutlass(text: str) -> Iterable[Hit]:
    """Flag each CUTLASS / CuTe include; in a file that includes neither, each line naming `cutlass::` or `cute::`
    (reached through another header), once per line."""
    includes = list(_CUTLASS_INCLUDE.finditer(text))
    lines = set()
    for match in includes or _CUTLASS_NAME.finditer(text):
        line, column = _position(text, match.start())
        if line not in lines:
            lines.add(line)
            yield Hit(line, column)

# ---- functions: where each is defined, what it returns, whether it runs on the device ---------------

_CONTROL = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype", "alignof", "do", "else", "new",
            "constexpr", "consteval"}  # `if constexpr (...)`
_ATTRIBUTES = {"__launch_bounds__", "__attribute__", "alignas", "__align__", "__declspec"}
_CALLABLE_HEAD = re.compile(r"(~?\w+)\s*(?:<(?:[^<>;{}]|<[^<>;{}]*>)*>)?\s*\(")
_AFTER_PARAMETERS = re.compile(r"^(?:\s|const\b|noexcept\b|override\b|final\b|mutable\b|&|->[^;{}]*)*$|^\s*:")
_DEVICE_WORD = re.compile(r"\b__(?:device|global)__\b")
_CLASS_QUALIFIER = re.compile(r"(?:\w+\s*(?:<(?:[^<>]|<[^<>]*>)*>)?\s*::\s*)+$")


@dataclass(frozen=True)
class Function:
    """A function a source defines: its name, what is written before the name (qualifiers and return type,
    without a `Class<T>::` qualification), whether it is compiled for the device, and where its body is."""

    name: str
    before_name: str
    device: bool
    body_start: int  # just past the opening brace
    body_end: int  # at the closing brace


def _blank_template_heads(text: str) -> str:
    """`text` with each `template <...>` head (angle brackets nested to any depth, a macro call inside:
    `template <typename P, ENABLE_IF(is_policy_v<remove_cvref_t<P>>)>`) blanked to spaces, positions kept."""
    blanked = list(text)
    for head in re.finditer(r"\btemplate\s*<", text):
        depth, index = 0, head.end() - 1
        while index < len(text):
            depth += {"<": 1, ">": -1}.get(text[index], 0)
            if depth == 0:
                break
            index += 1
        blanked[head.start() : index + 1] = " " * (index + 1 - head.start())
    return "".join(blanked)


def _signature(header: str) -> tuple[str, str] | None:
    """(name, text before the name) when `header` (the text before a `{`) ends a function's signature: a name and
    its closed parameter list (not a call still open, as in `f(std::decay_t<P>{ p }, ...)`), then qualifiers only."""
    searched = _blank_template_heads(header)
    for head in _CALLABLE_HEAD.finditer(searched):
        if head.group(1) in _ATTRIBUTES or head.group(1) in _CONTROL:
            continue
        close = head.end() + len(_balanced_args(header, head.end() - 1))
        if close >= len(header) or header[close] != ")":
            return None
        after = header[close + 1 :]
        before = _TEMPLATE_HEAD.sub("", header[: head.start()])  # `template <typename V = T>` is no assignment
        if _AFTER_PARAMETERS.match(after) and "=" not in before.replace("operator", ""):
            return head.group(1), _CLASS_QUALIFIER.sub("", header[: head.start()])
        return None
    return None


@functools.lru_cache(maxsize=4)  # three rules read one file's functions
def functions(text: str) -> tuple[Function, ...]:
    """The functions `text` defines, members included (lambdas and local classes stay part of their function's
    body; a macro whose body is a braced block, `#define CHECK(x) { ... }`, is none); a qualifier macro counts as
    `__device__` when its definition holds it (`#define HD __host__ __device__`)."""
    macros = [name for name, expr in source_constants(text).items() if _DEVICE_WORD.search(expr)]
    device = re.compile("|".join([_DEVICE_WORD.pattern, *(rf"\b{re.escape(name)}\b" for name in macros)]))
    found, depth, head_start, open_function = [], 0, 0, None
    for index, char in enumerate(text):
        if char == "{":
            header = text[head_start:index]
            if open_function is None and not header.lstrip().startswith("#") and (signature := _signature(header)):
                open_function = (*signature, bool(device.search(header)), index + 1, depth)
            depth += 1
        elif char == "}":
            depth -= 1
            if open_function is not None and depth == open_function[4]:
                found.append(Function(*open_function[:4], body_end=index))
                open_function = None
        if char in ";{}" or (char == "\n" and text[head_start:index].lstrip().startswith("#")):
            head_start = index + 1
    return tuple(found)


# Lanes exchange values or vote, or the code asks the hardware's warp width: which threads share a warp shows.
# (Not PTX `mma` / `ldmatrix`: the 32 lanes of their fragment layouts go with an instruction `ptx-mma` flags, which an
# AMD port rewrites whole.)
_WARP_LEVEL_OP = re.compile(
    r"__shfl|__ballot|__activemask|__any\b|__all\b|__match_\w+|__syncwarp|\bwarpSize\b|%laneid|"
    r"\b\w+_sync\s*\(|"  # every warp-collective CUDA call: __any_sync, __reduce_add_sync, wmma::mma_sync, ...
    r"\b(?:shfl|vote|redux)\.|"  # the same in inline PTX
    r"\.\s*(?:shfl\w*|ballot|any|all|match_\w+)\s*\(|tiled_partition|thread_block_tile|"  # cooperative groups
    r"\bWarp(?:Reduce|Scan|Load|Store|Exchange)\b|WarpStriped|WARP_(?:TRANSPOSE|STRIPED)"  # CUB, layouts by warp
)
# helpers from other headers, by name: WARP_SHFL(...), warpReduceSum(...), BlockReduce(...); a name the file defines
# (a function, a macro, a lambda) is judged by its body instead
_WARP_HELPER_NAME = re.compile(r"\b(\w*(?i:shfl|shuffle)\w*)\s*\(|\b(\w*(?i:warp|block)_?(?i:reduce|scan|allreduce|vote|broadcast)\w*)\s*[<(]")
_LAMBDA = re.compile(r"\bauto\s+(\w+)\s*=\s*\[")
_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(.*(?:\\\n.*)*)", re.MULTILINE)


@functools.lru_cache(maxsize=4)
def lane_blind_functions(text: str) -> tuple[Function, ...]:
    """The functions whose results cannot depend on how many lanes a warp has: no shuffle (but those of an
    explicit width of at most 32 lanes), vote, warp collective or `warpSize` in their body, and no call of a
    function or macro that has one. In them, 32 used
    on a thread index (`threadIdx.x / 32`, `% 32`) only lays out data, which a 64-lane wavefront computes alike."""
    defined = functions(text)
    lane_dependent = _explicit_width_shuffles(text, source_constants(text))
    own_names = {f.name for f in defined} | set(_LAMBDA.findall(text)) | {m.group(1) for m in _MACRO.finditer(text)}

    def warp_level_code(start: int, end: int) -> bool:
        return bool(_WARP_LEVEL_OP.search(lane_dependent, start, end)) or any(
            (helper.group(1) or helper.group(2)) not in own_names
            for helper in _WARP_HELPER_NAME.finditer(lane_dependent, start, end))

    warp_level = {macro.group(1) for macro in _MACRO.finditer(lane_dependent)
                  if warp_level_code(macro.start(2), macro.end(2))}
    warp_level |= {f.name for f in defined if warp_level_code(f.body_start, f.body_end)}
    while True:  # callers of warp-level functions are warp-level
        calls = re.compile(rf"\b(?:{'|'.join(map(re.escape, sorted(warp_level)))})\s*(?:<[^;{{}}]*?>)?\s*\(") if warp_level else None
        callers = {f.name for f in defined if f.name not in warp_level and calls and calls.search(text, f.body_start, f.body_end)}
        if not callers:
            break
        warp_level |= callers
    return tuple(f for f in defined if f.name not in warp_level)


@functools.lru_cache(maxsize=4)
def _body_starts(text: str) -> tuple[int, ...]:
    return tuple(f.body_start for f in functions(text))


def _header_start(text: str, function: Function) -> int:
    """Where `function`'s signature starts: just past the statement or block before it."""
    return max(text.rfind(";", 0, function.body_start - 1), text.rfind("}", 0, function.body_start - 1)) + 1


def function_header(text: str, function: Function) -> str:
    """`function`'s signature, from the end of the statement or block before it to its opening brace."""
    return text[_header_start(text, function) : function.body_start - 1]


def function_scope(text: str, function: Function) -> str:
    """`function`'s signature and body: from the end of the statement or block before it to its closing brace."""
    return text[_header_start(text, function) : function.body_end]


def enclosing_function(text: str, offset: int) -> Function | None:
    """The function of `functions` whose body holds `offset` (bodies do not nest: one search in their starts)."""
    index = bisect.bisect_right(_body_starts(text), offset) - 1
    if index >= 0 and offset < (function := functions(text)[index]).body_end:
        return function
    return None


def in_lane_blind_function(text: str, offset: int) -> bool:
    """Whether `offset` lies in the body of a function of `lane_blind_functions`."""
    function = enclosing_function(text, offset)
    return function is not None and function in lane_blind_functions(text)


def in_warp_level_launcher(text: str, offset: int) -> bool:
    """Whether `offset` lies in a host function that launches (or calls) a warp-level kernel of the file: its
    block shape decides which threads share a warp."""
    function = enclosing_function(text, offset)
    return function is not None and not function.device and function not in lane_blind_functions(text)


# ---- CUDA math functions HIP declares for the device only --------------------------------------

# CUDA's math headers give these host definitions too (for what the host C library lacks); HIP's are device-only.
_CUDA_HOST_MATH = re.compile(r"\b(rsqrtf?|rcbrtf?|sinpif?|cospif?|sincospif?|normcdff?|normcdfinvf?|erfinvf?|"
                             r"erfcinvf?|erfcxf?|norm[34]df?|rnorm[34]?df?|rnormf?|rhypotf?)\s*\(")


def check_host_math(text: str) -> Iterable[Hit]:
    """Flag a call of a CUDA math function that HIP declares only for the device (`rsqrtf`, `sinpif`,
    `normcdff`, ...) inside a function that is not compiled for the device (no `__device__` / `__global__`);
    a function calling itself by the same name is its own overload, not the math function."""
    for function in functions(text):
        if function.device:
            continue
        for call in _CUDA_HOST_MATH.finditer(text, function.body_start, function.body_end):
            if call.group(1) != function.name:
                yield Hit(*_position(text, call.start()), f"`{call.group(1)}` in host function `{function.name}`")


def check_constexpr_device_calls(text: str) -> Iterable[Hit]:
    """Flag a call of the file's own `constexpr __device__` function (no `__host__`) from host code: the body of a
    function not compiled for the device, or an initialiser outside every function (a `static constexpr` member)."""
    every = functions(text)
    device_only = {f.name for f in every if f.device and "constexpr" in f.before_name and "__host__" not in f.before_name}
    if not device_only:
        return
    device_bodies = [(f.body_start, f.body_end) for f in every if f.device]
    bodies = [(f.body_start, f.body_end) for f in every]
    call = re.compile(rf"(?<![\w.>:])({'|'.join(map(re.escape, sorted(device_only)))})\s*(?:<[^<>;(){{}}]*>)?\s*\(")
    for match in call.finditer(text):
        at = match.start()
        if any(start <= at < end for start, end in device_bodies):
            continue
        in_body = any(start <= at < end for start, end in bodies)
        statement = text[max(text.rfind(";", 0, at), text.rfind("{", 0, at), text.rfind("}", 0, at)) + 1 : at]
        if not in_body and not re.search(r"(?<![=!<>])=(?!=)|\breturn\b", statement):
            continue  # its own definition or a declaration, not a call in an initialiser
        yield Hit(*_position(text, at), f"`{match.group(1)}` is `constexpr __device__`: host code cannot call it")


# ---- C10_WARP_SIZE on the host ------------------------------------------------------------------

_HOST_WARP_SIZE = re.compile(rf"\bC10_WARP_SIZE\b|\b{_WARP_SIZE_NAME}\s*=(?!=)[^;]*?\b32[uU]?\b(?!\.)"
                             r"|\b\w*(?i:warp)\w*\s*=(?!=)[^;]*?/\s*\(?\s*32[uU]?\b(?!\.)")  # `warps_per_block = nthreads / 32`


# a macro or a constant like one (`WARP_SIZE`, `kWarpSize`), named for the warp size another header gives
_WARP_SIZE_MACRO = re.compile(r"\b[A-Z0-9_]*WARP_?SIZE[A-Z0-9_]*\b|\bkWarp(?:Size|Threads|Lanes)\b")


def check_host_warp_size(text: str) -> Iterable[Hit]:
    """Flag each line of a function not compiled for the device that uses `C10_WARP_SIZE`, sets a warp-size
    variable from a literal 32 (`warp_size = n < 32 ? n : 32;`) or a warp count by dividing by 32
    (`warps_per_block = nthreads / 32`), or uses a warp-size macro another file defines
    (`WARP_SIZE` or `kWarpSize` from a compat header, or the file's own alias of it outside any function,
    `constexpr int kLanes = kWarpSize;`: whatever it says, the host pass cannot know the device's width). A local
    alias is not followed (its defining line is the place to flag), nor a member of the same name (`block.x`)."""
    defined = source_constants(text)
    external = {name for name in set(_WARP_SIZE_MACRO.findall(text)) if name not in defined}
    pieces, end = [], 0  # the text outside function bodies (bodies do not nest)
    for function in functions(text):
        pieces += [text[end : function.body_start], " " * (function.body_end - function.body_start)]
        end = function.body_end
    aliases = {name for name, value in source_constants("".join([*pieces, text[end:]])).items() if value in external}
    use_pattern = re.compile(rf"(?<!\.)(?<!->)\b(?:{'|'.join(sorted(external | aliases))})\b") if external else None
    for function in functions(text):
        if function.device:
            continue
        uses = [*_HOST_WARP_SIZE.finditer(text, function.body_start, function.body_end),
                *(use_pattern.finditer(text, function.body_start, function.body_end) if use_pattern else ())]
        first_on_line = {}
        for use in sorted(uses, key=lambda use: use.start()):
            first_on_line.setdefault(_position(text, use.start())[0], use)
        for use in first_on_line.values():
            yield Hit(*_position(text, use.start()), f"`{use.group(0).strip()}` in host function `{function.name}`")


# ---- CUDA intrinsics and overloads HIP does not have --------------------------------------------

_MISSING_INTRINSIC = re.compile(r"\b(?:__dp4a|__dp2a_(?:lo|hi)|__nanosleep|__reduce_\w+_sync|__double2half|"
                                r"__cvta_generic_to_\w+|make_bfloat162|"
                                r"__(?:u?int|u?short|u?ll)2bfloat16_r[nduz]|__bfloat162(?:u?int|u?short|u?ll)_r[nduz]|"
                                r"atomic(?:Add|Sub|Exch|Min|Max|Inc|Dec|CAS|And|Or|Xor)_block|"
                                r"__ldlu|__ldcv|__st(?:wb|cg|cs|wt)|"
                                r"__v(?:add|sub|abs|absdiff|avg|hadd|max|min|neg|sad|cmp(?:eq|ne|lt|le|gt|ge)|"
                                r"set(?:eq|ne|lt|le|gt|ge))(?:s|u|ss|us)?[24])\s*\(")
# cuda_bf16.h's float -> bf16 conversions that name their rounding, absent from HIP's amd_hip_bf16.h (checked through
# ROCm 7), and the call HIP has for each, exactly the same (its `__float2bfloat16` rounds to nearest even)
BF16_ROUNDING_EQUIVALENTS = {
    "__float2bfloat16_rn": "`__float2bfloat16(x)`",
    "__floats2bfloat162_rn": "`__float22bfloat162_rn(make_float2(a, b))`",
    "__float2bfloat162_rn": "`__bfloat162bfloat162(__float2bfloat16(x))`",
}
_BF16_ROUNDING_CALL = re.compile(rf"\b({'|'.join(BF16_ROUNDING_EQUIVALENTS)})\s*\(")
_MACRO_NAME = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", re.MULTILINE)
# CUDA 12's vector atomicAdd (sm_90): `float2 atomicAdd(float2*, float2)`, `float4 atomicAdd(float4*, float4)`
_VECTOR_ATOMIC_TYPE = r"float[24]"
# an address of the pointer's own type: `p + i`, `p - 1`, `&p[i]` -> `p` (not `&p->x`, `&p[i].y`: a member's)
_BASE_POINTER = re.compile(r"^\s*(\w+)\s*[-+][^,]*$|^\s*&\s*(\w+)\s*\[[^\]]*\]\s*$")


def _base_pointer(address: str) -> str:
    """The pointer an address is taken from where it has that pointer's type (`p + i`, `&p[i]`), else the address."""
    match = _BASE_POINTER.match(address)
    return (match.group(1) or match.group(2)) if match else address
# cache-hinted loads HIP declares for __half / __half2 only (amd_hip_fp16.h); CUDA has them for every type
_HALF_ONLY_LOAD = re.compile(r"\b__ld(?:cs|cg|ca)\s*\(")
_NON_HALF_TYPE = re.compile(r"\b(?:float|double|u?int|u?long|u?short|u?char|longlong|ulonglong|bfloat16|nv_bfloat16)\d?\b")
_HALF_TYPE = r"(?:__)?half2?"


_SHORT_TYPE = r"(?:unsigned\s+short(?:\s+int)?|short(?:\s+int)?|u?int16_t)"


def _points_to(address: str, type_pattern: str, declared: set[str]) -> bool:
    """Whether a call's address argument is a pointer of `type_pattern`: a name `declared` so in the file, or a
    C-style or reinterpret cast to it."""
    return (address in declared or re.match(rf"\(\s*{type_pattern}\s*\*\s*\)", address) is not None
            or re.search(rf"reinterpret_cast\s*<\s*{type_pattern}\s*\*\s*>", address) is not None)


def check_missing_intrinsics(text: str) -> Iterable[Hit]:
    """Flag calls of CUDA intrinsics HIP lacks (the cache-hinted `__ldcs` / `__ldcg` / `__ldca` where a cast
    names a non-half type: HIP has them for half only; the bf16 conversions that name their rounding, with HIP's
    exact equivalent), `atomicAdd` on half or half2 (HIP has no such overload):
    its value a variable declared `half` / `half2` in its function (in the file, outside any function) or a
    `__halves2half2(...)`, or its address a half pointer, `atomicAdd` on float2 / float4 (CUDA 12's sm_90 overloads:
    its address such a pointer, its value such a vector), and `atomicCAS` on a 16-bit address (HIP has none). An
    intrinsic the file defines itself in code hipcc compiles (a polyfill or a macro under `#ifdef USE_ROCM`, an
    `atomicAdd(float2*, float2)` of its own) is flagged neither where it is defined nor where it is called."""
    # the file's own functions and macros of those names (`#define __float2bfloat16_rn __float2bfloat16`)
    polyfilled = {function.name for function in functions(text)} | set(_MACRO_NAME.findall(text))
    for call in _MISSING_INTRINSIC.finditer(text):
        if call.group(0).rstrip("( \t\n") not in polyfilled:
            yield Hit(*_position(text, call.start()))
    for call in _BF16_ROUNDING_CALL.finditer(text):
        if call.group(1) not in polyfilled:
            yield Hit(*_position(text, call.start()), f"HIP's bf16 header has no `{call.group(1)}`: "
                      f"{BF16_ROUNDING_EQUIVALENTS[call.group(1)]} is the same conversion (the torch engine writes it)")
    for call in _HALF_ONLY_LOAD.finditer(text):
        if _NON_HALF_TYPE.search(_balanced_args(text, call.end() - 1)):
            yield Hit(*_position(text, call.start()), "HIP has this load for __half / __half2 only")
    # the file's own overload (QUDA's, under USE_ROCM or for every target) is what the call reaches
    vector_atomic_defined = re.search(rf"\batomicAdd\s*\(\s*(?:const\s+)?{_VECTOR_ATOMIC_TYPE}\s*\*\s*\w*\s*,", text)

    def vectors_pointed_to(scope: str) -> set[str]:
        return set(re.findall(rf"\b{_VECTOR_ATOMIC_TYPE}\s*\*\s*(?:__restrict__\s+)?(\w+)\s*[=;,)]", scope))

    for call in re.finditer(r"\batomicAdd\s*\(", text):
        arguments = split_arguments(_balanced_args(text, call.end() - 1))
        if len(arguments) != 2:
            continue
        address, value = arguments
        function = enclosing_function(text, call.start())
        scope = function_scope(text, function) if function else text
        halves = set(re.findall(rf"\b{_HALF_TYPE}\s+(\w+)\s*[=;,)]", scope))
        if value in halves or value.startswith("__halves2half2") or _points_to(address, _HALF_TYPE, set()):
            yield Hit(*_position(text, call.start()), "HIP has no atomicAdd for __half / __half2")
        elif not vector_atomic_defined and (
                _points_to(_base_pointer(address), _VECTOR_ATOMIC_TYPE, vectors_pointed_to(scope))
                or re.match(rf"make_{_VECTOR_ATOMIC_TYPE}\s*\(", value)
                or value in set(re.findall(rf"\b{_VECTOR_ATOMIC_TYPE}\s+(\w+)\s*[=;,)]", scope))):
            yield Hit(*_position(text, call.start()), "HIP has no atomicAdd for float2 / float4 (CUDA 12's, sm_90 "
                      "only): add the components, `atomicAdd(&p->x, v.x); atomicAdd(&p->y, v.y);` (each one atomic, "
                      "not the pair)")
    shorts = set(re.findall(rf"\b{_SHORT_TYPE}\s*\*\s*(\w+)\s*[=;,)]", text))
    for call in re.finditer(r"\batomicCAS\s*\(", text):
        arguments = split_arguments(_balanced_args(text, call.end() - 1))
        if len(arguments) == 3 and _points_to(arguments[0], _SHORT_TYPE, shorts):
            yield Hit(*_position(text, call.start()), "HIP has no 16-bit atomicCAS")


# ---- __ldg on torch's Half: no overload under hipcc ------------------------------------------------

_TORCH_HALF = r"(?:scalar_t|(?:at|c10)::Half)"  # scalar_t: the type AT_DISPATCH_*HALF* (and its kin) binds


def check_ldg_torch_half(text: str) -> Iterable[Hit]:
    """Flag `__ldg(p)` where `p` points to `scalar_t` or `at::Half` (declared so in the file): torch declares
    `__ldg(const c10::Half*)` only for nvcc and clang-CUDA, and HIP's own overloads take builtin types and
    `__half`, so a kernel dispatched for Half does not compile under hipcc."""
    for call in re.finditer(r"\b__ldg\s*\(", text):
        pointer = re.match(r"[\s&(]*(\w+)", _balanced_args(text, call.end() - 1))
        if pointer and re.search(rf"\b{_TORCH_HALF}\s*(?:const\s*)?\*\s*(?:const\s*)?(?:__restrict__\s*)?{pointer.group(1)}\b", text):
            yield Hit(*_position(text, call.start()), f"`{pointer.group(1)}` points to a type torch dispatches as at::Half")


# ---- `= {}` on a half: ambiguous under hipcc -----------------------------------------------------

def check_half_brace_assign(text: str) -> Iterable[Hit]:
    """Flag `h = {};` where `h` is declared `half` / `half2` (`__half`, `__half2`) in the file; not the declaration
    `__half2 h = {};` (value-initialisation, no assignment)."""
    halves = set(re.findall(rf"\b{_HALF_TYPE}\s+(\w+)\s*[=;,)\[]", text))
    for assign in re.finditer(r"\b(\w+)\s*=\s*\{\s*\}", text):
        declared_here = re.search(rf"\b{_HALF_TYPE}\s*$", text[text.rfind("\n", 0, assign.start()) + 1 : assign.start()])
        if assign.group(1) in halves and not declared_here:
            yield Hit(*_position(text, assign.start()), f"`{assign.group(1)}` is a half type")


# ---- non-void functions that fall off their end -----------------------------------------------

_NOT_A_RETURN_TYPE = {"static", "inline", "constexpr", "extern", "virtual", "explicit", "friend", "__host__", "__device__",
                      "__global__", "__forceinline__", "__noinline__", "__inline__", "const"}


_ENABLE_IF = re.compile(r"\benable_if(?:_t)?\s*<")


def _enable_if_void(return_type: str) -> bool:
    """Whether `return_type` is SFINAE's void: `std::enable_if<cond>::type`, `enable_if<cond, void>::type` or
    `enable_if_t<cond>` (a comparison in the condition is parenthesised, as C++ requires of `>`)."""
    match = _ENABLE_IF.search(return_type)
    if match is None:
        return False
    arguments, start, angles, parens = [], match.end(), 1, 0
    for index in range(match.end(), len(return_type)):
        char = return_type[index]
        parens += {"(": 1, ")": -1}.get(char, 0)
        if parens == 0 and char in "<>":
            angles += 1 if char == "<" else -1
        if angles == 0 or (char == "," and angles == 1 and parens == 0):
            arguments.append(return_type[start:index].strip())
            start = index + 1
            if angles == 0:
                break
    return len(arguments) == 1 or (len(arguments) == 2 and arguments[1] == "void")


def check_missing_return(text: str) -> Iterable[Hit]:
    """Flag a function with a return type other than void (or auto) whose body has no `return` (nor a
    `throw`, `abort`, `__builtin_unreachable` or `__trap`, nor a project macro named for a return such as
    `BF_TRY_RETURN(...)` or PETSc's `PetscFunctionReturn(...)`), at its closing brace: falling off the end of such a
    function is undefined behaviour that clang (hipcc) optimises as unreachable, while nvcc returns whatever the
    register held."""
    classes = set(re.findall(r"\b(?:class|struct)\s+(\w+)", text))  # a function named after one is its constructor
    macros = set(source_constants(text))  # qualifier macros (`#define HOST_DEVICE __host__ __device__`)
    for function in functions(text):
        header = function_header(text, function)
        name = re.escape(function.name)
        if function.name in classes or re.search(rf"\b{name}\s*(?:<[^<>]*>\s*)?::\s*{name}\s*\(", header):
            continue  # a constructor, also one defined outside its class (`Point::Point() {`)
        before = re.sub(r"template\s*<(?:[^<>]|<[^<>]*>)*>|__launch_bounds__\s*\([^()]*\)|\b(?:public|private|protected)\s*:"
                        r"|^[ \t]*#.*$", " ", function.before_name, flags=re.MULTILINE)  # and directives between them
        words = [word for word in re.findall(r"\w+", before)
                 if word not in _NOT_A_RETURN_TYPE and word not in macros and not re.fullmatch(r"[A-Z0-9]+_[A-Z0-9_]+", word)]
        returns_nothing = ((words and words[-1] in ("void", "auto") and not re.search(r"[*&]\s*$", before))
                           or _enable_if_void(before))
        if not words or returns_nothing or "operator" in words or function.name == "main":
            continue
        body = text[function.body_start : function.body_end]
        if not re.search(r"\b(?:return|throw|abort|exit|__builtin_unreachable|__trap|assert\s*\(\s*(?:false|0))\b"
                         r"|\b\w*(?:RETURN|Return)\w*\s*\(", body):
            yield Hit(*_position(text, function.body_end), f"`{function.name}` returns `{' '.join(words)}` and ends here")


_NVRTC_CALL = re.compile(r"\bnvrtc\w+\s*\(")
_NVRTC_ONLY = re.compile(r"\"(?:-arch=|--gpu-architecture=|-arch\s|--gpu-architecture\s)?compute_\w*\"|\"-arch=\"?"
                         r"|--device-as-default-execution-space\b|-?-use_fast_math\b")


def check_nvrtc_options(text: str) -> Iterable[Hit]:
    """In a file that calls NVRTC: its virtual-architecture options (`-arch=compute_XY`), the default-device option
    hiprtc lacks and `--use_fast_math`."""
    if not _NVRTC_CALL.search(text):
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if (match := _NVRTC_ONLY.search(line)) is not None:
            yield Hit(number, match.start() + 1)


_GET_PTX = re.compile(r"\bnvrtcGetPTX\s*\(")
_PTX_NAME = r"\w*(?i:ptx)\w*"
_PTX_C_STRING_ARGUMENT = re.compile(rf"\b({_PTX_NAME})\s*\.\s*c_str\s*\(\s*\)")


def _c_string_uses(name: str) -> re.Pattern:
    """Where a `char*` named `name` is read up to its first NUL: printed, assigned to a string, measured, copied."""
    word = re.escape(name)
    return re.compile(rf"<<\s*{word}\b(?!\s*[.\[(])|=\s*{word}\s*;|\b(?:strlen|strcpy|strdup|std::string)\s*\(\s*{word}\s*\)"
                      rf"|\bstd::string\s+\w+\s*\(\s*{word}\s*\)")


def check_code_object_text(text: str) -> Iterable[Hit]:
    """In a file that calls `nvrtcGetPTX` (hipify: `hiprtcGetCode`, an AMD code object with NUL bytes): a `char*` the
    result is written through and read as a C string (printed, assigned to a `std::string`, `strlen`), and a PTX
    string's `c_str()` passed on without its size (`kernel.set(name, ptx.c_str())`), where a callee taking a C string
    cuts the code object at its first NUL. A buffer kept with its size (`std::vector<char>`, `write(p, size)`) is
    fine."""
    if not _GET_PTX.search(text):
        return
    aliases = set()
    for call in _GET_PTX.finditer(text):
        arguments = split_arguments(_balanced_args(text, call.end() - 1))
        buffer = re.match(r"\s*&?\s*(\w+)\s*(?:\[\s*0\s*\])?\s*$", arguments[-1]) if len(arguments) == 2 else None
        if buffer and re.search(rf"\bchar\s*\*\s*{buffer.group(1)}\s*=", text):
            aliases.add(buffer.group(1))
    for name in sorted(aliases):
        declaration = re.search(rf"\bchar\s*\*\s*{name}\s*=", text)
        yield Hit(*_position(text, declaration.start()), f"the code object in `char* {name}`")
        for use in _c_string_uses(name).finditer(text):
            yield Hit(*_position(text, use.start()), f"`{name}` read as a C string")
    for use in _PTX_C_STRING_ARGUMENT.finditer(text):
        call = text[text.rfind("(", 0, use.start()) : _statement_end(text, use.end())]
        if not re.search(rf"\b{use.group(1)}\s*\.\s*(?:size|length)\s*\(", call):
            yield Hit(*_position(text, use.start()), f"`{use.group(1)}.c_str()` passed on without its size")


# ---- what HIP's headers already define: a second definition is a clash or an ambiguous call ----

_VECTOR_TYPE = r"(?:u?char|u?short|u?int|u?long|u?longlong|float|double)[1-4]"
# HIP's amd_hip_atomic.h (ROCm 6.0) also defines the unsigned long overloads CUDA lacks (Add, Sub, Exch, CAS, Min, Max)
_ATOMIC_TYPE = r"(?:float|double|unsigned\s+long(?!\s+long))"
_ULL = r"unsigned\s+long\s+long(?:\s+int)?"
_NAMED_NAMESPACE = re.compile(r"\bnamespace\s+\w+(?:\s*::\s*\w+)*\s*\{")


def _in_named_namespace(text: str, index: int) -> bool:
    """Whether `text[index]` lies within the braces of a named namespace."""
    for opening in _NAMED_NAMESPACE.finditer(text, 0, index):
        depth = 0
        for i in range(opening.end() - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
        if i > index:
            return True
    return False


_NVSHMEM = re.compile(r"#\s*include\s*[<\"](?:\w+/)*nvshmemx?\w*\.h[>\"]|\bnvshmemx?i?_\w+|\bNVSHMEMX?_\w+")


def check_nvshmem(text: str) -> Iterable[Hit]:
    """Flag NVSHMEM's headers, calls and constants, except inside a branch taken only when a flag naming NVSHMEM is
    set (`#ifdef HAVE_NVSHMEM`): the project already builds without it, as a HIP build must."""
    optional_after = {}  # 0-based line of a directive -> whether the lines after it are in such a branch
    optional = []  # per open conditional: whether its current branch is taken only with an NVSHMEM flag
    for directive in directives(text):
        names_flag = "NVSHMEM" in directive.condition.upper() and "!" not in directive.condition
        if directive.kind in ("if", "ifdef", "ifndef"):
            optional.append(names_flag)
        elif directive.kind in ("elif", "else"):
            optional[-1] = directive.kind == "elif" and names_flag
        else:
            optional.pop()
        optional_after[directive.last] = any(optional)
    skipping = False
    for number, line in enumerate(text.splitlines(), start=1):
        if number - 1 in optional_after:
            skipping = optional_after[number - 1]
            continue
        if not skipping:
            for match in _NVSHMEM.finditer(line):
                yield Hit(number, match.start() + 1)


_ATOMIC_REDEFINITION = re.compile(
    rf"\b{_ATOMIC_TYPE}\s+(atomic(?:Max|Min|Add|Sub|Exch|CAS))\s*\(\s*{_ATOMIC_TYPE}\s*\*[^;{{}}]*\)\s*\{{"
    # and atomicSub on unsigned long long, which CUDA lacks and ROCm 6.0's amd_hip_atomic.h defines
    rf"|\b{_ULL}\s+(atomicSub)\s*\(\s*{_ULL}\s*\*[^;{{}}]*\)\s*\{{")
# the bit casts HIP defines `__device__ static inline` (amd_device_functions.h, ROCm 6.0): a project's own definition
# (a CPU build's union pun) is a redefinition where hipcc compiles it
_BIT_CAST_REDEFINITION = re.compile(
    r"\b(__(?:float_as_u?int|u?int_as_float|double_as_longlong|longlong_as_double|hiloint2double|double2hiint|"
    r"double2loint))\s*\([^;{}()]*\)\s*\{")
_VECTOR_OPERATOR = re.compile(rf"\boperator\s*(\*|/|[-+*/]=)\s*\(\s*(?:const\s+)?({_VECTOR_TYPE})\s*&?\s*\w*\s*,"
                              rf"\s*(?:const\s+)?\2\s*&?\s*\w*\s*\)\s*\{{")
# cuComplex.h's types, which the translation makes hipFloatComplex / hipDoubleComplex: hip_complex.h gives them
# `__host__ __device__` arithmetic and compound operators of its own; and a file's alias of one (QuEST's `cu_qcomp`)
_CUDA_COMPLEX = r"(?:cuFloatComplex|cuDoubleComplex|cuComplex)"
_COMPLEX_ALIAS = re.compile(rf"\btypedef\s+{_CUDA_COMPLEX}\s+(\w+)\s*;|\busing\s+(\w+)\s*=\s*{_CUDA_COMPLEX}\s*;"
                            rf"|^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+{_CUDA_COMPLEX}[ \t]*$", re.MULTILINE)


def _complex_operator(text: str) -> re.Pattern:
    """A definition of an arithmetic or compound operator between two values of a CUDA complex type or the file's
    alias of one (each alias group of `_COMPLEX_ALIAS` one name)."""
    aliases = {name for match in _COMPLEX_ALIAS.finditer(text) for name in match.groups() if name}
    types = "|".join([_CUDA_COMPLEX, *sorted(aliases)])
    return re.compile(rf"\boperator\s*([-+*/]=?)\s*\(\s*(?:const\s+)?({types})\s*&?\s*\w*\s*,"
                      rf"\s*(?:const\s+)?\2\s*&?\s*\w*\s*\)\s*\{{")


def _sides(qualifiers: str, macros: dict[str, str], depth: int = 0) -> tuple[set[str], list[str]]:
    """The `__host__` / `__device__` words of a declaration's `qualifiers`, this file's macros expanded, and the
    all-caps names it leaves unexplained (macros of another header)."""
    sides, unknown = set(), []
    for word in re.findall(r"\b\w+\b", qualifiers):
        if word in ("__host__", "__device__"):
            sides.add(word)
        elif word in macros and depth < 4:
            inner, more = _sides(macros[word], macros, depth + 1)
            sides |= inner
            unknown += more
        elif re.fullmatch(r"[A-Z][A-Z0-9_]*", word):
            unknown.append(word)
    return sides, unknown


def check_builtin_redefinitions(text: str) -> Iterable[Hit]:
    """Flag a definition of what HIP's headers define themselves: `atomicMax` / `atomicMin` / `atomicAdd` on
    `float*` / `double*`, the atomics on `unsigned long*` and `atomicSub` on `unsigned long long*` (which CUDA does not
    declare), the bit casts (`__float_as_int`, `__int_as_float`, ...: HIP's are `static inline`);
    and `*`, `/` or a compound assignment between two CUDA vector values (`float2`, ...), or any arithmetic or
    compound operator between two cuComplex values (or the file's alias of the type: hip_complex.h has them all),
    declared `__host__ __device__` (as HIP_vector_type's hidden friends and members are): a `__device__`-only or
    host-only one wins clang's same-side preference, so only these make calls ambiguous. One whose qualifiers come
    from another header's macro is flagged as that macro's question. An atomic defined in a named namespace is an
    overload there (calls in the namespace find it first), not a redefinition."""
    for match in _ATOMIC_REDEFINITION.finditer(text):
        if _in_named_namespace(text, match.start()):  # an overload in the project's namespace, not HIP's global one
            continue
        name = match.group(1) or match.group(2)
        yield Hit(*_position(text, match.start()), f"HIP's headers define `{name}` on this type: a redefinition")
    for match in _BIT_CAST_REDEFINITION.finditer(text):
        yield Hit(*_position(text, match.start()), f"HIP's headers define `{match.group(1)}`: a redefinition")
    macros = source_constants(text)
    operators = [(match, f"HIP's `{match.group(2)}` (a HIP_vector_type)") for match in _VECTOR_OPERATOR.finditer(text)]
    if "Complex" in text:
        operators += [(match, f"`{match.group(2)}` (hipFloatComplex / hipDoubleComplex once translated: hip_complex.h)")
                      for match in _complex_operator(text).finditer(text)]
    for match, owner in operators:
        declaration = max(text.rfind(c, 0, match.start()) for c in ";{}") + 1
        qualifiers = re.sub(r"^\s*#.*$", "", text[declaration : match.start()], flags=re.MULTILINE)
        sides, unknown = _sides(qualifiers, macros)
        ambiguous = f"{owner} has `__host__ __device__` `{match.group(1)}` on two of them"
        if sides == {"__host__", "__device__"}:
            yield Hit(*_position(text, match.start()), f"{ambiguous}: every such call is ambiguous")
        elif not sides and unknown:
            yield Hit(*_position(text, match.start()),
                      f"{ambiguous}: ambiguous if `{unknown[0]}` (from another header) makes it __host__ __device__")


# ---- builtins and libraries whose HIP side depends on the ROCm or torch version ------------------

_SCOPED_ATOMIC = re.compile(r"\b__scoped_atomic_(\w+?)(?:_n)?\s*\(")
_HIP_ATOMIC = {"compare_exchange": "__hip_atomic_compare_exchange_strong"}  # else __hip_atomic_<operation>
_HIP_SCOPE = {"DEVICE": "AGENT", "WRKGRP": "WORKGROUP", "WVFRNT": "WAVEFRONT", "SINGLE": "SINGLETHREAD"}


def check_scoped_atomics(text: str) -> Iterable[Hit]:
    """Flag clang's `__scoped_atomic_*` builtins (LLVM 18, so ROCm >= 6.2), naming the `__hip_atomic_*` builtin and
    `__HIP_MEMORY_SCOPE_*` that every ROCm >= 6.0 has."""
    for call in _SCOPED_ATOMIC.finditer(text):
        operation = call.group(1)
        arguments = split_arguments(_balanced_args(text, call.end() - 1))
        scope = re.fullmatch(r"\s*__MEMORY_SCOPE_(\w+)\s*", arguments[-1]) if arguments else None
        hip_scope = f"__HIP_MEMORY_SCOPE_{_HIP_SCOPE.get(scope.group(1), scope.group(1))}" if scope else "__HIP_MEMORY_SCOPE_*"
        builtin = _HIP_ATOMIC.get(operation, f"__hip_atomic_{operation}")
        yield Hit(*_position(text, call.start()), f"`{builtin}(..., {hip_scope})` compiles on ROCm 6.0 and 6.1 too")


_ROCBLAS = re.compile(r"\brocblas_\w+")
_CUBLAS = re.compile(r"\bcublas\w*|\bCUBLAS_\w+")
_TORCH_VERSION = re.compile(r"\bTORCH_VERSION_\w+")


def check_rocblas_branches(text: str) -> Iterable[Hit]:
    """Flag each `#if` / `#ifdef` on an AMD macro whose branch calls rocBLAS, in a file that calls cuBLAS, unless
    the condition tests the torch version: hipify (torch >= 2.1's too) turns the cuBLAS side into hipBLAS, whose
    handles and types the rocBLAS branch then receives. `text` keeps the branches hipcc compiles out."""
    if not _CUBLAS.search(text):
        return  # a project written against rocBLAS itself
    found = directives(text)
    handle = ("`at::cuda::getCurrentCUDABlasHandle()`" if "getCurrentCUDABlasHandle" in text
              else "the callers' cuBLAS handle")
    for directive in found:
        if (directive.kind in ("else", "endif") or directive.enclosed_dead or not _AMD_MACRO.search(directive.condition)
                or on_amd(directive.condition) is False or _TORCH_VERSION.search(directive.condition)):
            continue
        following = next((d for d in found if d.group == directive.group and d.first > directive.first), None)
        if following is not None and _ROCBLAS.search(_branch_body(text, directive, following)):  # None: never closed
            yield _directive_hit(text, directive, f"{handle} is a hipblasHandle_t once hipified (torch >= 2.1)")


_THRUST_INCLUDE = re.compile(r"^[ \t]*#\s*include\s*[<\"]thrust/[^>\"]+[>\"]", re.MULTILINE)


def check_unused_thrust(text: str) -> Iterable[Hit]:
    """Flag each `#include <thrust/...>` of a file that names nothing of Thrust (no `thrust::`)."""
    return _unused_includes(_THRUST_INCLUDE, re.compile(r"\bthrust::"), text)


def _unused_includes(include: re.Pattern, use: re.Pattern, text: str) -> Iterable[Hit]:
    """Each line `include` matches, in a file where `use` matches nothing outside those lines."""
    if use.search(include.sub("", text)):
        return
    for match in include.finditer(text):
        yield Hit(*_position(text, match.start() + len(match.group(0)) - len(match.group(0).lstrip())))


_NVTX_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*[<\"](?:nvtx3/)?nvToolsExt\w*\.h[>\"]", re.MULTILINE)


def check_unused_nvtx(text: str) -> Iterable[Hit]:
    """Flag each NVTX include (`nvToolsExt.h`) of a file that names nothing of NVTX (no `nvtx...` call or type)."""
    return _unused_includes(_NVTX_INCLUDE, re.compile(r"\bnvtx\w+", re.IGNORECASE), text)


_EXTERN_C_OPEN = re.compile(r'\bextern\s+"C"\s*\{')
# a CUDA toolkit header, or a project header named for CUDA (`mc_cuda.h`), which includes them
_CUDA_HEADER_INCLUDE = re.compile(
    r'^[ \t]*#[ \t]*include[ \t]*[<"](?:[^<>"]*/)?(?:cub/|thrust/|cuda/|(?i:\w*cuda\w*)\.h|'
    r'(?:cu(?:blas|fft|rand|sparse|solver|Complex|dnn|tensor)\w*|nvrtc|nccl|vector_types|math_constants)\.h)', re.MULTILINE)


def check_extern_c_includes(text: str) -> Iterable[Hit]:
    """Flag an `#include` of a CUDA header (or a project header named for CUDA) inside an `extern "C" { ... }` block."""
    for block in _EXTERN_C_OPEN.finditer(text):
        depth, end = 1, block.end()
        for brace in re.finditer(r"[{}]", text[block.end():]):
            depth += 1 if brace.group(0) == "{" else -1
            if depth == 0:
                end = block.end() + brace.start()
                break
        else:
            end = len(text)
        for include in _CUDA_HEADER_INCLUDE.finditer(text, block.end(), end):
            yield Hit(*_position(text, include.start() + len(include.group(0)) - len(include.group(0).lstrip())))


_BF16_VALUE = re.compile(r"\b(?:__)?nv_bfloat162?\s+(?:const\s+)?(\w+)\s*[,)=;]")


def check_bf16_arithmetic(text: str) -> Iterable[Hit]:
    """Flag `a + b`, `a * b`, `a += b` ... in a function where both operands are declared CUDA bf16 values
    (parameters or locals): ROCm 6.0's `__hip_bfloat16` has no arithmetic operators (6.1 added them)."""
    for function in functions(text):
        names = set(_BF16_VALUE.findall(function_scope(text, function)))
        if not names:
            continue
        either = "|".join(map(re.escape, sorted(names)))
        operation = re.compile(rf"\b({either})\s*([-+*/]=?)\s*({either})\b")
        for use in operation.finditer(text, function.body_start, function.body_end):
            yield Hit(*_position(text, use.start()), f"`{use.group(0)}` on bf16 values in `{function.name}`")


# ---- C++ that hipcc's clang rejects or ROCm 7 no longer takes ------------------------------------

_CONSTANT_CONTEXTS = (  # (where a constant expression is required, what it is)
    (re.compile(r"\b(?!return\b|case\b|else\b|throw\b|delete\b|new\b)[\w:]+\s+\w+\s*\[[^\]\n;]*\bwarpSize\b[^\]\n;]*\]"),
     "an array bound"),  # not `new int[n * warpSize]`: a size read at run time
    (re.compile(r"\bconstexpr\b[^;{}]*=[^;{}]*\bwarpSize\b"), "a constexpr initialiser"),
    (re.compile(r"\bstatic_assert\s*\([^;]*\bwarpSize\b"), "a static_assert"),
    (re.compile(r"\b\w+<[^<>;(){}=&|]*\bwarpSize\b[^<>;(){}=&|]*>"), "a template argument"),
)


# the built-in's name, not a member of the project's (`GpuConfig::warpSize`, `cfg.warpSize`)
_BUILTIN_WARP_SIZE = re.compile(r"(?<!::)(?<!\.)(?<!->)\bwarpSize\b")
# a file that declares its own `warpSize` (`static constexpr int warpSize = 64;`, `#define warpSize 32`) means it there
_OWN_WARP_SIZE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+warpSize\b|\b(?:int|unsigned|size_t|auto|\w+_t)\s+warpSize\s*[={]",
                            re.MULTILINE)


def check_constexpr_warp_size(text: str) -> Iterable[Hit]:
    """Flag `warpSize` where C++ needs a constant: an array bound (`__shared__ float s[N / warpSize]`), a
    constexpr initialiser, a static_assert or a template argument. HIP declared it `static constexpr` up to
    ROCm 6.x; ROCm 7.0 makes it a value read at run time, and CUDA's never was a constant. Not a project's own
    constant of that name: a member (`GpuConfig::warpSize`), or `warpSize` where the file declares one."""
    if _OWN_WARP_SIZE.search(text):
        return
    for context, what in _CONSTANT_CONTEXTS:
        for match in context.finditer(text):
            if builtin := _BUILTIN_WARP_SIZE.search(match.group(0)):
                yield Hit(*_position(text, match.start() + builtin.start()), f"`warpSize` in {what}")


_WARP_SIZE_ASSERT = re.compile(
    rf"\bstatic_assert\s*\(\s*((?:\w+::)*{_WARP_SIZE_NAME}\s*==\s*32[uU]?)\s*[,)]"
    rf"|\bstatic_assert\s*\(\s*(32[uU]?\s*==\s*(?:\w+::)*{_WARP_SIZE_NAME})\s*[,)]"
    # another constant held to 32, its message saying why ("relies on block_size == warp_size")
    r"|\bstatic_assert\s*\(\s*((?:\w+::)*\w+\s*==\s*32[uU]?)\s*,\s*\"[^\"\n]*(?i:warp)"
    # a run-time list of the warp sizes accepted, ending at 32: `ws != 16 && ws != 32` rejects a wavefront of 64
    rf"|\b({_WARP_SIZE_NAME})\s*!=\s*16[uU]?\s*&&\s*(\4\s*!=\s*32[uU]?)\b(?!\s*&&\s*\4\s*!=\s*64)")


def check_warp_size_asserts(text: str) -> Iterable[Hit]:
    """Flag a `static_assert` that a warp-size constant is 32, or that another constant is 32 with a message that
    names the warp, and a run-time list of accepted warp sizes that ends at 32; the assertion may span lines (the
    finding sits on the comparison with 32)."""
    for match in _WARP_SIZE_ASSERT.finditer(text):
        yield Hit(*_position(text, match.start(match.lastindex)))


def _in_device_code(text: str, pattern: re.Pattern) -> Iterable[tuple[Function, re.Match]]:
    """Each match of `pattern` in the body of a function compiled for the device, with that function."""
    for function in functions(text):
        if function.device:
            for match in pattern.finditer(text, function.body_start, function.body_end):
                yield function, match


def check_device_std_clamp(text: str) -> Iterable[Hit]:
    """Flag `std::clamp(` in a function compiled for the device: libstdc++ 14 asserts its bounds through a host
    function, which hipcc refuses to call from device code (nvcc's own headers never reach that assert)."""
    for function, call in _in_device_code(text, re.compile(r"\bstd::clamp\s*\(")):
        yield Hit(*_position(text, call.start()), f"in `{function.name}`")


# Standard-library class templates whose deduction guides are host functions under hip-clang, and members that
# reach a host-only `__throw_*` helper (bounds-checked access, an empty optional's value).
_DEDUCED_STD = re.compile(r"\bstd::(?:array|pair|tuple|optional|complex)(?=\s*[{(]|\s+\w+\s*(?:[{(]|=\s*\{))")
_THROWING_MEMBER = {"array": "at", "vector": "at", "string": "at", "basic_string": "at", "deque": "at", "map": "at",
                    "unordered_map": "at", "optional": "value"}
_STD_DECLARATION = re.compile(rf"\bstd::({'|'.join(_THROWING_MEMBER)})\s*<")


def check_device_std_printf(text: str) -> Iterable[Hit]:
    """Flag `std::printf(` / `std::fprintf(` in a function compiled for the device: `std::printf` names the host
    C library's function (libstdc++'s `using ::printf`), not the device printf HIP declares."""
    for function, call in _in_device_code(text, re.compile(r"\bstd::f?printf\s*\(")):
        yield Hit(*_position(text, call.start()), f"in `{function.name}`")


# HIP's vector types (HIP_vector_type<T, N>) take one value (an explicit broadcast) or all N; CUDA's are aggregates.
_VECTOR_INIT = re.compile(
    r"\b(?:u?char|u?short|u?int|u?long|u?longlong|float|double)([234])\s+\w+\s*(=\s*)?\{([^{};]*)\}")


def check_vector_partial_init(text: str) -> Iterable[Hit]:
    """Flag `float3 v = {a, b}` (fewer values than members, CUDA's aggregate fills the rest with zeros) and
    `float4 v = {a}` (HIP's one-value constructor is explicit: no copy-list-initialisation)."""
    for match in _VECTOR_INIT.finditer(text):
        values = len(split_arguments(match.group(3))) if match.group(3).strip() else 0
        members = int(match.group(1))
        if 1 < values < members or (values == 1 and match.group(2)):
            yield Hit(*_position(text, match.start()), f"{values} of {members} values")


# a broadcast from lane 0: `__shfl(v, 0)`, `__shfl_sync(mask, v, 0)`, `tile.shfl(v, 0)`
_LANE0_BROADCAST = re.compile(r"(?:\b__shfl_sync\s*\(\s*[^,()]+,|\b__shfl\s*\(|\.\s*shfl\s*\()\s*(\w+)\s*,\s*0\s*[,)]")


def check_uninitialised_broadcast(text: str) -> Iterable[Hit]:
    """Flag the declaration without initialiser (`size_t pos;`) of a local that a shuffle then broadcasts from lane
    0 (`tile.shfl(pos, 0)`), the other lanes' value never written."""
    for function in functions(text):
        broadcasts: dict[tuple[int, str], list[int]] = {}  # a declaration -> the lines broadcasting it (one finding)
        for call in _LANE0_BROADCAST.finditer(text, function.body_start, function.body_end):
            name, before = call.group(1), text[function.body_start : call.start()]
            declared = list(re.finditer(rf"(?:^|[;{{}}])\s*(?:[A-Za-z_][\w:]*\s+)+{name}\s*;", before))
            if declared:
                at = function.body_start + declared[-1].end() - 1 - len(name)
                broadcasts.setdefault((at, name), []).append(_position(text, call.start())[0])
        for (at, name), lines in broadcasts.items():
            where = "line" + ("s " if len(lines) > 1 else " ") + ", ".join(map(str, lines))
            yield Hit(*_position(text, at), f"`{name}` is broadcast from lane 0 at {where}")


def check_device_ctad(text: str) -> Iterable[Hit]:
    """Flag a standard-library class template written without its arguments (`std::array{1, 2}`,
    `std::pair p(a, b)`) in a function compiled for the device: the deduction goes through a guide hip-clang takes
    for a host function."""
    for function, use in _in_device_code(text, _DEDUCED_STD):
        yield Hit(*_position(text, use.start()), f"in `{function.name}`")


def _names_declared_as(text: str) -> dict[str, str]:
    """Variables, parameters and members declared in `text` as one of `_THROWING_MEMBER`'s standard types: name ->
    the member that throws on them."""
    declared = {}
    for match in _STD_DECLARATION.finditer(text):
        close = _closing_angle(text, match.end() - 1)
        name = re.match(r">\s*(?:const\s*)?[&*]?\s*(\w+)\s*[;,)={\[]", text[close:]) if close is not None else None
        if name:
            declared[name.group(1)] = _THROWING_MEMBER[match.group(1)]
    return declared


def check_device_std_throw(text: str) -> Iterable[Hit]:
    """Flag `x.at(i)` on a `std::array` / `std::vector` / ... and `x.value()` on a `std::optional`, declared so in the
    file (member chains count by their last name: `dist.poly.at(1)`), in a function compiled for the device: both
    reach libstdc++'s host-only `__throw_out_of_range_fmt` / `__throw_bad_optional_access`."""
    declared = _names_declared_as(text)
    if not declared:
        return
    call = re.compile(rf"\b({'|'.join(map(re.escape, sorted(declared)))})\s*(?:\.|->)\s*(at|value)\s*\(")
    for function, use in _in_device_code(text, call):
        if declared[use.group(1)] == use.group(2):
            yield Hit(*_position(text, use.start()), f"`{use.group(1)}.{use.group(2)}()` in `{function.name}`")


# ---- cooperative-groups APIs HIP does not have -------------------------------------------------

_CG_MISSING_HEADER = re.compile(r"^[ \t]*#[ \t]*include[ \t]*[<\"]cooperative_groups/(?:reduce|scan|memcpy_async)\.h[>\"]",
                                re.MULTILINE)
_CG_MISSING_NAMES = (r"(?:reduce|inclusive_scan|exclusive_scan|labeled_partition|binary_partition|memcpy_async|"
                     r"wait_prior|wait|invoke_one|invoke_one_broadcast)\s*[(<]"
                     r"|(?:plus|less|greater|bit_and|bit_or|bit_xor)\s*<")
# a tile or coalesced group: declared by type, or as `auto` from tiled_partition / coalesced_threads
_CG_TILE = re.compile(r"\b(?:thread_block_tile\s*<[^<>;]*>|coalesced_group)\s*&?\s*(\w+)\s*[=;,)({]"
                      r"|\bauto\s*&?\s*(\w+)\s*=\s*(?:\w+\s*::\s*)*(?:tiled_partition|coalesced_threads)\b")
_CG_TILE_VOTE = r"\s*\.\s*(?:any|all|ballot|match_any|match_all)\s*\("


def check_cooperative_groups_api(text: str) -> Iterable[Hit]:
    """Flag the cooperative-groups headers and calls HIP lacks (checked against ROCm/clr's
    amd_hip_cooperative_groups.h through ROCm 6.2): `<cooperative_groups/reduce.h>` / `scan.h` / `memcpy_async.h`,
    `cg::reduce` and its functors (`cg::plus<T>`), the scans, `labeled_partition`, `memcpy_async` / `wait`,
    `invoke_one`, through the namespace or any alias of it (`namespace cg = cooperative_groups;`); and what came
    only in ROCm 6.3 (clr 36d58c65): a tile's or coalesced group's votes (`tile.any(p)`, `all`, `ballot`,
    `match_any`, `match_all`) and `binary_partition`."""
    aliases = {"cooperative_groups", *re.findall(r"\bnamespace\s+(\w+)\s*=\s*(?:::)?cooperative_groups\s*;", text)}
    use = re.compile(rf"\b(?:{'|'.join(sorted(aliases))})\s*::\s*(?:{_CG_MISSING_NAMES})")
    hits = {_position(text, found.start())[0]: found.start() for found in _CG_MISSING_HEADER.finditer(text)}
    tiles = {name for match in _CG_TILE.finditer(text) for name in match.groups() if name}
    votes = re.finditer(rf"\b(?:{'|'.join(sorted(tiles))}){_CG_TILE_VOTE}", text) if tiles else ()
    for found in (*use.finditer(text), *votes):
        hits.setdefault(_position(text, found.start())[0], found.start())
    for offset in sorted(hits.values()):
        yield Hit(*_position(text, offset))


# ---- the built-in index variables: unsigned, and proxies before ROCm 6.1 ----------------------

_BUILTIN_INDEX = r"(?:threadIdx|blockIdx|blockDim|gridDim)\s*\.\s*[xyz]"
_INDEX_ELEMENT = re.compile(rf"[{{,]\s*({_BUILTIN_INDEX})\s*(?=[,}}])")
# types a built-in index initialises without narrowing: unsigned or wider, and HIP's vector types (constructor
# templates, not aggregates: `int2 v{threadIdx.x, 0}` compiles)
_TAKES_AN_INDEX = re.compile(r"^(?:dim3|unsigned|uint(?:8|16|32|64)?_t|int64_t|size_t|long|uint|auto|"
                             r"u?(?:char|short|int|long|longlong)[1-4]|float[1-4]|double[1-4])$")
_DECLARED_TYPE = re.compile(r"(\w+)\s*(?:<(?:[^<>;]|<[^<>;]*>)*>)?\s*(?:[&*]\s*)?(?:\w+\s*(?:\[[^\]]*\]\s*)?(?:=\s*)?)?$")


def _opening_brace(text: str, offset: int) -> int | None:
    """The `{` of the brace list holding `offset` (None inside parentheses, brackets or past a statement's end)."""
    depth = 0
    for index in range(offset, max(-1, offset - 400), -1):
        char = text[index]
        if char in ")]}":
            depth += 1
        elif char in "([{":
            if depth == 0:
                return index if char == "{" else None
            depth -= 1
        elif char == ";" and depth == 0:
            return None
    return None


def check_builtin_index_narrowing(text: str) -> Iterable[Hit]:
    """Flag a bare built-in index in a braced initialiser (`Reduce({threadIdx.x, gain}, op)`, `Pair p{blockIdx.x}`,
    `return {threadIdx.x, v};`) unless the type it initialises, where the code names it (before the brace, before
    the variable, or as the function's return type), takes one without narrowing (`dim3`, `uint32_t`, `int2`):
    the index is `unsigned int`, and list-initialising an `int` or a `float` from it is an error under clang."""
    for element in _INDEX_ELEMENT.finditer(text):
        brace = element.start() if text[element.start()] == "{" else _opening_brace(text, element.start() - 1)
        if brace is None:
            continue
        before = text[max(0, brace - 120) : brace].rstrip()
        if before.endswith(("(", ",")):
            declared = None  # a parameter: its type is elsewhere
        elif before.endswith("return"):
            function = enclosing_function(text, brace)
            declared = re.search(r"(\w+)\s*[&*]?\s*$", function.before_name) if function else None
        else:
            declared = _DECLARED_TYPE.search(before)
            if not declared or before.endswith(")") or declared.group(1) in _CONTROL:
                continue  # a block
        if declared and _TAKES_AN_INDEX.match(declared.group(1)):
            continue
        yield Hit(*_position(text, element.start(1)))


def check_auto_builtin_index(text: str) -> Iterable[Hit]:
    """Flag `auto i = blockIdx.y` (or another built-in index) where `i` is then changed (`i += gridDim.y`, `++i`)."""
    for declared in re.finditer(rf"\bauto\s+(\w+)\s*=\s*{_BUILTIN_INDEX}\s*[;,)]", text):
        name = declared.group(1)
        function = enclosing_function(text, declared.start())
        end = function.body_end if function else len(text)
        if re.search(rf"\b{name}\s*(?:[-+*/]=|\+\+|--)|(?:\+\+|--)\s*{name}\b", text[declared.end() - 1 : end]):
            yield Hit(*_position(text, declared.start()), f"`{name}`")


# ---- device functions defined in another translation unit -------------------------------------

_DEVICE_PROTOTYPE = re.compile(r"(?:^|[;{}])\s*((?:template\s*<(?:[^<>]|<[^<>]*>)*>\s*)?"
                               r"(?:(?:static|inline|extern|__forceinline__|__noinline__)\s+)*__device__\b[^;{}()]*?"
                               r"\b(\w+)\s*\((?:[^()]|\([^()]*\))*\)\s*(?:const\s*)?;)", re.MULTILINE)


def _in_a_body(text: str, offset: int) -> bool:
    """Whether `offset` lies in a function body: the innermost open brace before it follows a parameter list
    (`operator T*() {` included, which `functions` does not name)."""
    depth = 0
    for index in range(offset - 1, -1, -1):
        if text[index] == "}":
            depth += 1
        elif text[index] == "{":
            if depth == 0:
                return bool(re.search(r"\)\s*(?:const\s*|noexcept\s*|override\s*)*$", text[max(0, index - 200) : index]))
            depth -= 1
    return False


_SPACED_LAUNCH = re.compile(r"[\w>]\s*(?:<<\s+<|<\s+<<)(?!<)[^;{}]*?(?:>>\s+>|>\s+>>)")


def check_spaced_launches(text: str) -> Iterable[Hit]:
    """Flag a launch whose chevrons are split by spaces (`k << <grid, block >> > (args)`), its arguments on one line
    or over several (darknet's `<< <` ... `>> >` launches wrapped by a formatter)."""
    for match in _SPACED_LAUNCH.finditer(text):
        yield Hit(*_position(text, match.start()))


def check_device_declarations(text: str) -> Iterable[Hit]:
    """Flag a `__device__` function declared without a body that the file never defines: its body is in another
    translation unit, which nvcc links with relocatable device code (`-rdc`, CUDA_SEPARABLE_COMPILATION) and a HIP
    build only with `-fgpu-rdc`. Not an explicit instantiation (`template __device__ T f<int>(...);`), nor a
    declaration inside a function (`extern __device__ void error(void);`: a symbol left undefined on purpose, so a
    template that must not be instantiated fails to link), nor a `static` one: internal linkage puts its body in the
    same translation unit (a header's forward declaration the including file defines, CP2K's grid kernels)."""
    defined = {function.name for function in functions(text)}
    for match in _DEVICE_PROTOTYPE.finditer(text):
        declaration, name = match.group(1), match.group(2)
        if (name in defined or "__global__" in declaration or _in_a_body(text, match.start(1))
                or re.match(r"template\s+__device__|template\s*[^<\s]", declaration)
                or re.search(r"\bstatic\b", declaration[: declaration.find(name)])):
            continue
        yield Hit(*_position(text, match.start(1)), f"`{name}` is defined elsewhere")


# `this_grid()` read for an index or a size only (`cg::this_grid().thread_rank()`) needs no co-resident grid
_GRID_SYNC = re.compile(r"\bthis_grid\s*\((?!\s*\)\s*\.\s*(?:thread_rank|size|num_threads|block_rank|num_blocks|"
                        r"dim_blocks|block_index|thread_index|is_valid)\s*\()|\bgrid_group\b|\bcudaLaunchCooperativeKernel\w*")
_COOPERATIVE_LAUNCH = re.compile(r"\b(?:cuda|hip)LaunchCooperativeKernel\w*")
_DEVICE_SIZED_GRID = re.compile(r"OccupancyMaxActiveBlocksPerMultiprocessor|\bmulti[Pp]rocessorCount\b|MultiProcessorCount\b")


def check_grid_sync(text: str) -> Iterable[Hit]:
    """Flag grid synchronisation (`this_grid()`, `grid_group`, a cooperative launch), except in a file that launches
    cooperatively with a grid sized from the device (an occupancy query or the multiprocessor count): every
    block is then resident on AMD too."""
    if _COOPERATIVE_LAUNCH.search(text) and _DEVICE_SIZED_GRID.search(text):
        return
    yield from pattern_hits(_GRID_SYNC, text.splitlines())


_ASM = re.compile(r"\b(?:asm|__asm__|__asm)\s*(?:volatile|__volatile__)?\s*\(")
_ASM_TEMPLATE = re.compile(r'"((?:\\.|[^"\\])*)"')
_AMD_MNEMONIC = re.compile(r"\b(?:v|s|ds|buffer|global|flat|scratch)_[a-z0-9_]+\b")
_PTX_INSTRUCTION = re.compile(r"\b[a-z]+(?:\.[a-z0-9]+)*\.(?:[usbf](?:8|16|32|64)|f16x2|bf16x2|pred|global|shared|sync|aligned)\b|%%?laneid")


def check_inline_asm(text: str) -> Iterable[Hit]:
    """Flag inline assembly, except an empty template (a compiler barrier: `asm volatile("" ::: "memory")`, which
    clang takes) and AMD GPU assembly (GCN mnemonics such as `v_add3_u32`, no PTX instruction): a port's own."""
    for call in _ASM.finditer(text):
        arguments, pieces, end = _balanced_args(text, call.end() - 1), [], 0
        for literal in _ASM_TEMPLATE.finditer(arguments):  # the template: the literals before the first `:`
            if ":" in arguments[end : literal.start()]:
                break
            pieces.append(literal.group(1))
            end = literal.end()
        template = " ".join(pieces)
        amd_only = _AMD_MNEMONIC.search(template) and not _PTX_INSTRUCTION.search(template)
        if template.strip() and not amd_only:
            yield Hit(*_position(text, call.start()))


# ---- `#pragma unroll` on a loop whose trip count hip-clang cannot compute ----------------------------

_UNROLLED_FOR = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+unroll\b(?![ \t]*\(?[ \t]*1[ \t]*\)?[ \t]*$)[^\n]*\n\s*for\s*\(",
                           re.MULTILINE)
_GEOMETRIC_STEP = re.compile(r"^\s*(\w+)\s*(?:>>=|<<=|\*=|/=)|^\s*(\w+)\s*=\s*\2\s*(?:>>|<<|\*|/)")
_LAUNCH_SHAPE = re.compile(r"\b(?:blockDim|gridDim|threadIdx|blockIdx)\b")
_MEMBER_CALL = re.compile(r"\b\w+\s*(?:\.|->)\s*\w+\s*\(")
_INNER_BREAK_SCOPE = re.compile(r"\b(?:for|while|switch)\s*\(")  # a `break` inside one leaves only it


def _parameter_names(header: str) -> set[str]:
    """The names of the parameters in a function signature (`header`: text up to its opening brace)."""
    searched = _blank_template_heads(header)
    heads = [head for head in _CALLABLE_HEAD.finditer(searched) if head.group(1) not in _ATTRIBUTES]
    if not heads:
        return set()
    # an array parameter's extents are not its name (`double rC[THR_N][THR_M]`, `float x[kN][1 << kLogN]`)
    names = (re.findall(r"\w+", _ARRAY_EXTENTS.sub("", parameter.split("=", 1)[0])) for parameter in
             split_arguments(_balanced_args(header, heads[0].end() - 1)))
    return {words[-1] for words in names if len(words) > 1}


_ARRAY_EXTENTS = re.compile(r"\[[^\[\]]*\]")


def _read_at_run_time(expr: str, scope: str, parameters: set[str], loop_variable: str, depth: int = 0) -> bool:
    """Whether `expr` can differ between launches of one instantiation: it reads the launch shape, a parameter
    of the function, or a local computed from them (followed through `scope` three assignments deep)."""
    if _LAUNCH_SHAPE.search(expr):
        return True
    # an object whose member is called (`strides.Capacity()`) says nothing: the member may be a constant
    names = set(_NAME.findall(_MEMBER_CALL.sub("", expr))) - {loop_variable}
    if names & parameters:
        return True
    return depth < 3 and any(_read_at_run_time(source, scope, parameters, loop_variable, depth + 1)
                             for name in names for source in _definitions(name, scope))


def check_unroll_unknown_trip(text: str) -> Iterable[Hit]:
    """Flag `#pragma unroll` (any count but 1) on a `for` loop LLVM cannot count: a geometric step (`offset >>= 1`)
    from a start or to a bound known only at run time (`blockDim.x / 2`), or an early exit (`break`, `return`) from a
    loop whose bound or step is known only at run time; and on a loop with a run-time bound around another such
    unrolled loop (PyTorch's depthwise convolution: `kH < KH_LIMIT` around `kW < KW_LIMIT`): the inner one is unrolled
    at run time, with a remainder loop, and the outer one, no longer innermost, is not (clang 15 for gfx90a, one
    warning per such outer loop; an inner loop without the pragma, or with a constant bound, leaves the outer one
    unrolled). hip-clang then warns 'loop not unrolled' (-Wpass-failed) for each instantiation; nvcc drops the request
    silently. Bounds from template parameters or constants are known, so those loops unroll."""
    loops = list(_unrolled_loops(text))
    for pragma, body_start, body_end, bound_at_run_time, why in loops:
        if why:
            yield Hit(*_position(text, pragma), why)
        elif bound_at_run_time and any(body_start < inner < body_end and inner_run_time
                                       for inner, _, _, inner_run_time, _ in loops):  # fmt: skip
            yield Hit(*_position(text, pragma), "a loop unrolled at run time inside it")


def _unrolled_loops(text: str) -> Iterable[tuple[int, int, int, bool, str | None]]:
    """Each `for` loop under `#pragma unroll` (count not 1) inside a function: where its pragma starts, its body's
    span, whether its bound or step is read at run time, and why LLVM cannot count it (None: it can, or may)."""
    for pragma in _UNROLLED_FOR.finditer(text):
        function = enclosing_function(text, pragma.start())
        if function is None:
            continue
        clauses = split_arguments(_balanced_args(text, pragma.end() - 1).replace(";", ","))
        if len(clauses) != 3:  # a range-based for, or a declaration of several variables
            continue
        init, condition, step = clauses
        loop_variable = (re.search(r"(\w+)\s*=", init) or re.search(r"(\w+)", step + " _")).group(1)
        scope = text[function.body_start : function.body_end]  # not the signature: template defaults hold `=`
        parameters = _parameter_names(function_header(text, function))

        def run_time(*clauses: str) -> bool:
            return any(_read_at_run_time(clause, scope, parameters, loop_variable) for clause in clauses)

        body_start = pragma.end() + len(_balanced_args(text, pragma.end() - 1)) + 1
        body_end = _statement_end(text, body_start)
        bound_at_run_time, why = run_time(condition, step), None
        if _GEOMETRIC_STEP.search(step) and run_time(init, condition):
            why = "a geometric step from a run-time value"
        elif bound_at_run_time and _exits_early(text[body_start:body_end]):  # from a run-time start: at most n trips
            why = "an early exit from a loop with a run-time bound"
        yield pragma.start(), body_start, body_end, bound_at_run_time, why


def _exits_early(body: str) -> bool:
    """Whether a loop `body` can leave its loop before the bound: a `return` or `goto`, or a `break` outside the
    loops and switches nested in it."""
    if re.search(r"\b(?:return|goto)\b", body):
        return True
    own = body
    for inner in _INNER_BREAK_SCOPE.finditer(body):
        start = inner.end() + len(_balanced_args(body, inner.end() - 1)) + 1
        end = _statement_end(body, start)
        own = own[:start] + " " * (end - start) + own[end:]
    return re.search(r"\bbreak\b", own) is not None


def _statement_end(text: str, start: int) -> int:
    """Where the statement from `start` ends: past its block's closing brace, or its semicolon."""
    opening = re.match(r"\s*\{", text[start:])
    if opening is None:
        end = text.find(";", start)
        return len(text) if end < 0 else end + 1
    depth, index = 0, start + opening.end() - 1
    for index in range(index, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return index + 1
    return len(text)


# ---- the table ---------------------------------------------------------------------------------

RULES: list[Rule] = [
    Rule(
        "warp-size-define", "error", "warp size hard-coded as 32",
        "CDNA GPUs (MI200 gfx90a, MI300 gfx942) run 64-lane wavefronts: every lane index, warp count "
        "and reduction derived from this constant covers only half a wavefront, so results are wrong "
        "without any error.",
        "Use `warpSize` at run time, or a per-target constant (64 for gfx9xx, 32 for gfx1xxx) chosen "
        "with `#if defined(__GFX9__)`, and size shared buffers for 64.",
        before="#define WARP_SIZE 32",
        after="#define WARP_SIZE warpSize  // or 64 under #if defined(__GFX9__)",
        check=check_warp_size_definitions,
    ),
    Rule(
        "warp-size-literal", "error", "lane/warp arithmetic assumes 32 lanes",
        "`% 32`, `/ 32`, `& 31`, `>> 5` and `< 32` on thread indices compute lane and warp ids for "
        "32-lane warps; on a 64-lane wavefront two 'warps' share one wavefront and lanes 32-63 get the "
        "wrong ids.",
        "Compute `lane = threadIdx.x % warpSize` and `warp = threadIdx.x / warpSize` (or use a "
        "per-target constant), and loop over `warpSize` lanes.",
        before="int lane = threadIdx.x % 32, warp = threadIdx.x / 32;",
        after="int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;",
        check=check_lane_arithmetic,
    ),
    Rule(
        "warp-lane-loop", "error", "shuffle loop covers 32 lanes",
        "A butterfly or tree reduction starting at offset 16 (or running to 32) combines 32 lanes; on a "
        "64-lane wavefront each half reduces separately and the result holds half the sum.",
        "Start the loop at `warpSize / 2` (and loop while `offset > 0`), or use a per-target constant.",
        before="for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(mask, v, offset);",
        after="for (int offset = warpSize / 2; offset > 0; offset /= 2) v += __shfl_xor(v, offset);",
        check=check_lane_loops,
    ),
    Rule(
        "lane-indexed-warp-array", "error", "per-warp array indexed by a lane id",
        "The array has one slot per warp, sized for 32-lane warps (`[32]`, `[kThreads / 32]`, `[kNumWarps]`), "
        "and the second reduction step reads it by lane id. On a 64-lane wavefront lanes run to 63, past the "
        "end of a 32-slot array, and a block holds half as many warps, so slots are read that no warp wrote.",
        "Size the array for the smallest wave (`kThreads / 32` stays safe) but guard the read with the real "
        "count, `lane < blockDim.x / warpSize ? buf[lane] : identity`.",
        before="__shared__ float warp_sums[32];\nv = warp_sums[lane];",
        after="__shared__ float warp_sums[32];\nv = lane < blockDim.x / warpSize ? warp_sums[lane] : 0.f;",
        check=check_per_warp_arrays,
    ),
    Rule(
        "warp-buffer-passed-on", "warning", "a 32-slot per-warp buffer handed to another file's warp helper",
        "A shared array sized for the warps of a 1024-thread block at 32 lanes (`[32]`) goes to a helper defined in "
        "another header. A helper that stores one slot per warp needs 16 on a 64-lane wavefront; one that stores a "
        "slot per lane of the first warp (a block prefix sum's second pass) writes 64 and runs past the array into "
        "the next shared variable. LightGBM's ROCm port sized every such buffer by the warp size.",
        "Size the buffer by the hardware's warp width (`[WARP_SIZE]` with WARP_SIZE 64 on gfx9xx), or read the "
        "helper and size it for what it writes.",
        before="__shared__ double partial[32];\nfloat total = ShufflePrefixSum<double>(v, partial);",
        after="__shared__ double partial[WARP_SIZE];  // 64 on gfx9xx\nfloat total = ShufflePrefixSum<double>(v, partial);",
        check=check_warp_buffers_passed_on,
    ),
    Rule(
        "block-32-threads", "warning", "32-thread block (half a wavefront)",
        "A block of 32 threads is one NVIDIA warp but half a CDNA wavefront: lanes 32-63 idle (half the "
        "throughput), and code written for 'one warp per block' sees `warpSize` 64 and a 32-thread block.",
        "Launch blocks of `warpSize` (or a multiple of 64) threads, or check that the kernel only uses the "
        "block as a group of 32 threads.",
        before="row_kernel<<<rows, 32>>>(x);  // or a launch table: scan_launch<32, 4, T>(params, stream);",
        after="row_kernel<<<rows, warp_size>>>(x);  // warp_size from hipDeviceProp_t::warpSize",
        check=check_32_thread_blocks,
    ),
    Rule(
        "warp-tile-32", "warning", "cooperative-groups tile of 32 used as a warp",
        "`tiled_partition<32>` / `thread_block_tile<32>` is half a wavefront on CDNA; code that treats "
        "it as 'the warp' (ballots, lane masks, one result per warp) is wrong there.",
        "Size tiles with the wavefront (`warpSize`), or check that the tile size is only a grouping choice.",
        before="auto warp = cg::tiled_partition<32>(block);\nif (warp.any(v > 0)) flag[warp.meta_group_rank()] = 1;",
        after="auto warp = cg::tiled_partition<64>(block);  // the wavefront on gfx9xx",
        check=check_warp_tiles,
    ),
    Rule(
        "warp-sync-skipped", "warning", "block barrier skipped once a reduction works within 32 lanes",
        "`if (offset > 16) __syncthreads();` leaves the last steps of a shared-memory tree to warp-synchronous "
        "execution: 32 lanes in lockstep that see each other's shared-memory writes without a barrier. Neither vendor "
        "promises that (CUDA wants `__syncwarp` since Volta); hip-clang keeps such values in registers or reorders "
        "the loads, and the reduction returns wrong sums (CloverLeaf's and TeaLeaf's HIP ports).",
        "Keep the barrier at every step, outside divergent branches, or finish the last 64 lanes with shuffles "
        "(`__shfl_down`) or hipCUB's WarpReduce.",
        before="if (offset > 16) __syncthreads();  // within a warp: no sync needed",
        after="__syncthreads();  // every step: the last ones are not warp-synchronous on AMD",
        check=check_skipped_barrier,
    ),
    Rule(
        "mask-32bit", "error", "32-bit lane mask in a warp function",
        "`0xffffffff` names lanes 0-31 only. On a 64-lane wavefront lanes 32-63 are left out, and "
        "HIP's `*_sync` functions (ROCm >= 6.2) reject a 32-bit mask at compile time; ROCm < 6.2 has no "
        "`*_sync` forms at all.",
        "Pass a 64-bit mask (`0xffffffffffffffffull`, or `__activemask()` stored in a 64-bit integer); "
        "for ROCm < 6.2 use the unmasked `__shfl_xor` / `__ballot` forms.",
        before="v += __shfl_down_sync(0xffffffff, v, offset);",
        after="v += __shfl_down_sync(0xffffffffffffffffull, v, offset);  // __shfl_down(v, offset) before ROCm 6.2",
        check=check_lane_masks,
    ),
    Rule(
        "ballot-32bit-result", "error", "ballot or active mask stored in 32 bits",
        "`__ballot_sync`, `__activemask` and a cooperative group's `ballot` return 64-bit masks on AMD; storing them in `unsigned`, "
        "`int` or `uint32_t` drops lanes 32-63, so counts and leader election are wrong.",
        "Store masks in `unsigned long long` / `uint64_t` (or `auto`) and count them with `__popcll` / `__ffsll`.",
        before="unsigned votes = __ballot_sync(mask, pred);",
        after="unsigned long long votes = __ballot_sync(mask, pred);",
        # a CG group's ballot too, a project's ballot macro (`BALLOT(pred)`, `WARP_BALLOT`), and a mask of the lanes
        # below this one built by a shift of 1 by the lane id (`(1 << indexInWarp) - 1`: lanes 32-63 shift past 32 bits)
        pattern=re.compile(r"\b(?<!long )(?:unsigned\s+int|unsigned|uint32_t|int32_t|int|uint)\s+\w+\s*=\s*"
                           r"(?:(?:__(?:ballot(?:_sync)?|activemask)|\w+\s*\.\s*ballot|[A-Z_]*BALLOT[A-Z_]*)\s*\("
                           r"|\(?\s*1[uU]?\s*<<\s*\(?\s*(?:\w*(?i:lane)\w*|indexInWarp)\b)"),
    ),
    Rule(
        "ballot-bit-test", "error", "a lane's bit of a ballot tested with a 32-bit one",
        "On a 64-lane wavefront a ballot has 64 bits, but `1 << j` is an `int`: shifted by 32 or more it is "
        "undefined (in practice the shift wraps or yields 0), so `mask & (1 << j)` misreads lanes 32-63.",
        "Shift in the mask's own type: `mask & (static_cast<decltype(mask)>(1) << j)`, or `(mask >> j) & 1`.",
        before="auto mask = __ballot_sync(full, valid);\nif (mask & (1 << j)) out[j] = v;",
        after="auto mask = __ballot_sync(full, valid);\nif ((mask >> j) & 1) out[j] = v;",
        check=check_ballot_bit_tests,
    ),
    Rule(
        "popc-32bit", "warning", "32-bit bit count of a lane mask",
        "`__popc`, `__ffs` and `__clz` take 32-bit integers: applied to a 64-bit ballot they count "
        "only lanes 0-31.",
        "Use `__popcll`, `__ffsll`, `__clzll` on lane masks.",
        before="int n = __popc(__ballot_sync(mask, pred));",
        after="int n = __popcll(__ballot_sync(mask, pred));",
        pattern=re.compile(r"\b__(?:popc|ffs|clz|brev)\s*\(\s*(?:__ballot|__activemask|\w*(?:ballot|vote|mask)\w*\s*\))", re.IGNORECASE),
    ),
    Rule(
        "inline-asm", "error", "inline assembly (PTX)",
        "PTX is NVIDIA's virtual ISA; hipcc cannot compile it, and AMD GCN/CDNA assembly differs in "
        "registers, instructions and wave size.",
        "Replace it with HIP intrinsics or clang builtins (`__builtin_amdgcn_*`, `__builtin_nontemporal_load`, "
        "`__lane_id()`), or guard it with `#if defined(__HIP_PLATFORM_AMD__)` and keep a portable path.",
        before='asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));',
        after="lane = __lane_id();",
        check=check_inline_asm,
    ),
    Rule(
        "ptx-mma", "error", "PTX tensor-core or async-copy instruction",
        "`mma.sync`, `wgmma`, `ldmatrix`, `stmatrix` and `cp.async` have no AMD equivalent with the same "
        "fragment layout; MFMA (CDNA) and WMMA (RDNA3) use different tile shapes and register layouts.",
        "Rewrite the tile loop with rocWMMA or `__builtin_amdgcn_mfma_*` builtins, or generate the kernel "
        "with TileLang / Composable Kernel for gfx90a / gfx942.",
        before='asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 ...");',
        after="acc = __builtin_amdgcn_mfma_f32_32x32x8f16(a, b, acc, 0, 0, 0);  // or rocWMMA",
        pattern=re.compile(r"\b(?:mma\.sync|wgmma\.|ldmatrix\.|stmatrix\.|cp\.async)"),
    ),
    Rule(
        "wmma", "error", "CUDA WMMA (mma.h) tensor-core API",
        "`nvcuda::wmma` and `<mma.h>` do not exist in HIP; hipify leaves them as they are and the "
        "fragment shapes and layouts are NVIDIA-specific.",
        "Port to rocWMMA (`#include <rocwmma/rocwmma.hpp>`, `rocwmma::fragment`, 16x16x16 tiles with "
        "wave64 on gfx90a/gfx942) or to MFMA builtins.",
        before="wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a;",
        after="rocwmma::fragment<rocwmma::matrix_a, 16, 16, 16, rocwmma::float16_t, rocwmma::row_major> a;",
        pattern=re.compile(r"#\s*include\s*[<\"]mma\.h[>\"]|\bnvcuda::|\bnamespace\s+nvcuda\b|\bwmma::"),
    ),
    Rule(
        "lds-limit", "error", "shared memory beyond the 64 KiB of LDS",
        "NVIDIA GPUs allow up to 227 KiB of dynamic shared memory per block after `cudaFuncSetAttribute`; "
        "AMD gives a workgroup at most 64 KiB of LDS on gfx90a, gfx942 and gfx1100, and the launch fails.",
        "Shrink the tile (fewer stages or a smaller block tile) so the block needs <= 64 KiB, or keep "
        "part of the data in registers.",
        before="cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);",
        after="constexpr int kStages = 2;  // 64 KiB: hipFuncSetAttribute((const void*)k, ..., 64 * 1024)",
        check=check_shared_memory,
    ),
    Rule(
        "launch-bounds-2nd-arg", "warning", "`__launch_bounds__` whose second argument asks more of HIP",
        "CUDA's second argument is the minimum number of blocks per SM; HIP reads it as the minimum "
        "number of waves per execution unit (four per CU). With blocks under 256 threads that demands more "
        "resident threads than the author asked for, and the compiler squeezes registers to get them "
        "(spills); with 256 threads or more, or a second argument of 1, HIP's reading is only looser.",
        "Drop the second argument, or translate it: min waves per EU = min blocks x ceil(threads / "
        "warpSize) / EUs per CU (4 on CDNA); tune with `__attribute__((amdgpu_waves_per_eu(...)))`.",
        before="__global__ void __launch_bounds__(64, 4) k();",
        after="__global__ void __launch_bounds__(64) k();",
        check=check_launch_bounds_min_blocks,
    ),
    Rule(
        "launch-bounds", "warning", "kernel launched with 257-1023 threads has no `__launch_bounds__`",
        "Without `__launch_bounds__`, hip-clang compiles a kernel for a default maximum work-group size "
        "(clang's `--gpu-max-threads-per-block`): 1024 threads in current clang (ROCm 5.2's hipcc writes "
        "`.max_flat_workgroup_size: 1024` for a kernel without bounds; ROCm 3.x's compilers assumed 256, and a "
        "larger launch failed). So the launch works, but registers are budgeted for 1024 threads: on CDNA "
        "(wave64, four SIMDs a CU) 16 waves share a CU's register file, at most 128 VGPRs a wave, where a "
        "512-thread block could have 256; a register-heavy kernel spills or runs fewer waves. At 1024 there is "
        "nothing to gain; up to 256, registers rarely limit. ROCm ports (apex's sync batch norm) state the "
        "block size they launch with.",
        "Add `__launch_bounds__(MAX_THREADS)` with the largest block the kernel is launched with (nvcc "
        "accepts it too, so keep one source).",
        before="#define MAX_BLOCK_SIZE 512\n__global__ void norm_kernel(float* x);\n"
               "norm_kernel<<<rows, std::min(cols, MAX_BLOCK_SIZE)>>>(x);",
        after="#define MAX_BLOCK_SIZE 512\n__global__ void __launch_bounds__(MAX_BLOCK_SIZE) norm_kernel(float* x);\n"
              "norm_kernel<<<rows, std::min(cols, MAX_BLOCK_SIZE)>>>(x);",
        check=check_launch_bounds,
    ),
    Rule(
        "bf16-type", "warning", "CUDA bfloat16 type or header",
        "HIP's bfloat16 is `__hip_bfloat16` from `<hip/hip_bf16.h>` (ROCm >= 5.7; older ROCm only has "
        "`hip_bfloat16`); some `__nv_bfloat162` intrinsics and conversions are missing or round differently.",
        "Build against ROCm >= 6, check every bf16 intrinsic you use exists in hip_bf16.h, and verify "
        "numerics against a float reference (`tiletune verify`).",
        before="#include <cuda_bf16.h>\n__nv_bfloat16 x;",
        after="#include <hip/hip_bf16.h>\n__hip_bfloat16 x;",
        check=check_bf16,
    ),
    Rule(
        "fp8-type", "error", "CUDA fp8 type or header",
        "MI300 (gfx942) implements fp8 as e4m3 FNUZ / e5m2 FNUZ: max 240 instead of 448, a different "
        "exponent bias, no negative zero and 0x80 as NaN. Bits written by NVIDIA e4m3 code decode to "
        "different values, and scales computed for 448 overflow.",
        "Use `__hip_fp8_e4m3_fnuz` / `__hip_fp8_e5m2_fnuz` from `<hip/hip_fp8.h>` on gfx942 (torch's "
        "`c10::Float8_e4m3fnuz` / `Float8_e5m2fnuz`; OCP types on gfx950), recompute scaling with the type's max, and never reinterpret fp8 bits across vendors.",
        before="__nv_fp8_e4m3 q = __nv_fp8_e4m3(x / scale);  // scale = amax / 448",
        after="__hip_fp8_e4m3_fnuz q = __hip_fp8_e4m3_fnuz(x / scale);  // scale = amax / 240 on gfx942",
        pattern=re.compile(r"\b__nv_fp8\w*|\b__NV_E[45]M[23]\b|\b__nv_cvt_\w*fp8\w*|#\s*include\s*[<\"]cuda_fp8\.h[>\"]"
                           r"|\b(?:c10|at|torch)::(?:ScalarType::|k)?Float8_e(?:4m3fn|5m2)\b"),  # torch's OCP types, not *fnuz
    ),
    Rule(
        "grid-sync", "warning", "cooperative-groups grid synchronisation",
        "`grid.sync()` deadlocks unless every block is resident at once and the kernel is launched with "
        "`hipLaunchCooperativeKernel`; AMD GPUs fit a different number of blocks per CU, so a grid size "
        "tuned on NVIDIA can hang.",
        "Launch with `hipLaunchCooperativeKernel`, size the grid from "
        "`hipOccupancyMaxActiveBlocksPerMultiprocessor` x CU count, and check "
        "`hipDeviceAttributeCooperativeLaunch`; or split the kernel in two launches.",
        before="cg::this_grid().sync();  // in k, launched as k<<<num_blocks, 256>>>(args)",
        after="hipLaunchCooperativeKernel((void*)k, blocks_per_cu * cu_count, 256, args, 0, stream);",
        check=check_grid_sync,
    ),
    Rule(
        "texture-reference", "error", "texture reference (legacy texture API)",
        "Texture references (`texture<...>` globals, `cudaBindTexture`) were removed in CUDA 12 and are "
        "deprecated, partly unsupported, in HIP.",
        "Use texture objects (`hipTextureObject_t` with `hipCreateTextureObject`) or plain `__ldg` / "
        "global loads.",
        before="texture<float, 1> tex;  cudaBindTexture(0, tex, data, bytes);",
        after="hipTextureObject_t tex;  hipCreateTextureObject(&tex, &resource, &texture_desc, nullptr);",
        pattern=re.compile(r"\btexture\s*<[^>]*>\s*\w+\s*;|\bcuda(?:Bind|Unbind)Texture\w*|\bcudaGetTextureReference\b"),
    ),
    Rule(
        "cutlass-cute", "error", "CUTLASS / CuTe include or name",
        "CUTLASS and CuTe are NVIDIA-only template libraries (PTX, tensor-core layouts); no hipify "
        "engine translates them. A file that reaches them through another header (`cutlass::fast_max` from a "
        "common header) fails the same way.",
        "Use Composable Kernel (ck, ck_tile: `ck_tile::max`) or hipBLASLt on AMD, or write the kernel in TileLang, "
        "which lowers to both CUDA and HIP (`tiletune kernels lower`).",
        before="#include <cutlass/gemm/device/gemm.h>\nreturn cutlass::fast_max(x, y);",
        after="#include <ck/tensor_operation/gpu/device/device_gemm.hpp>  // or hipBLASLt\nreturn ck_tile::max(x, y);",
        check=check_cutlass,
    ),
    Rule(
        "cudnn-api", "error", "cuDNN include or call",
        "cuDNN is NVIDIA's; AMD's library is MIOpen, whose API differs beyond the names: other argument orders "
        "(`miopenConvolutionForward` takes the workspace last, `miopenConvolutionBackwardWeights` dy before x), "
        "algorithms found by `miopenFind*` calls rather than picked, workspaces sized by calls of its own, little "
        "double precision. Translators respell a few names at most (torch's table: the handle, `cudnnCreate` -> "
        "`miopenCreate`) and leave calls that do not compile, or, respelt, compute something else.",
        "Write the MIOpen path under the HIP build (as hipCaffe and PaddlePaddle did), or call the framework's op "
        "(torch's convolution runs MIOpen on ROCm).",
        before="CUDNN_CHECK(cudnnConvolutionForward(handle, &one, x_desc, x, w_desc, w, conv_desc, algo, ws, ws_bytes,\n"
               "                                    &zero, y_desc, y));",
        after="MIOPEN_CHECK(miopenConvolutionForward(handle, &one, x_desc, x, w_desc, w, conv_desc, algo, &zero, y_desc,\n"
              "                                      y, ws, ws_bytes));",
        check=check_cudnn,
    ),
    Rule(
        "thrust-cuda-par", "warning", "`thrust::cuda::par` execution policy",
        "Translators only respell it `thrust::hip::par`: the build then needs rocThrust and hipCUB from "
        "ROCm, and CUDA-backend specifics (`par_nosync`, `thrust::cuda::pointer`, CUDA memory resources, "
        "CUB tuning policies) have no guaranteed rocThrust equivalent.",
        "Install rocthrust and hipcub, prefer the portable `thrust::device` (or `thrust::hip::par.on(stream)`), "
        "and check every `thrust::cuda::` symbol against rocThrust.",
        before="thrust::sort(thrust::cuda::par.on(stream), first, last);",
        after="thrust::sort(thrust::hip::par.on(stream), first, last);  // with rocThrust",
        pattern=re.compile(r"\bthrust::cuda(?:_cub)?::par\w*"),
    ),
    Rule(
        "dependent-template-name", "error", "dependent name without `template` / `typename`",
        "nvcc's front end guesses that `obj.get<N>()` calls a member template and that `T::value_type x` "
        "names a type when `obj` or `T` depends on a template parameter; hipcc (clang) follows the standard "
        "and stops with 'missing 'template' keyword prior to dependent template name' (or 'missing "
        "'typename''; for a temporary such as `Ktraits::BlockLoadT(storage).Load(...)`, 'parsed as a "
        "non-type, but instantiation yields a type'), so the port does not compile.",
        "Spell it out: `obj.template get<N>()`, `ptr->template get<N>()`, `typename T::value_type x`. Both "
        "forms are valid C++ that nvcc accepts too, so keep one source.",
        before="template <typename T, typename Traits> __device__ void f(Tile<T> tile, T* out) {\n"
               "  Traits::index_type i = 0;  out[i] = tile.get<2>();\n}",
        after="template <typename T, typename Traits> __device__ void f(Tile<T> tile, T* out) {\n"
              "  typename Traits::index_type i = 0;  out[i] = tile.template get<2>();\n}",
        check=check_dependent_names,
    ),
    Rule(
        "constexpr-std-minmax", "warning", "`std::max` / `std::min` in a `constexpr` initialiser",
        "Kernel traits often size shared memory with `static constexpr int kSmem = std::max({sizeof(A), "
        "sizeof(B)});` or `std::min(8, kNItems)`. nvcc evaluates the host standard library at compile time; "
        "ROCm's hipcc (ROCm 6.0, where mamba's selective-scan port hit it) stopped on these initialisers in "
        "device compilation and the port replaced them with its own constexpr helpers. Debian's hipcc 5.2 "
        "accepts them, so the rule warns rather than fails.",
        "Use a small constexpr helper of your own that both compilers evaluate (`a < b ? a : b`, or "
        "`*std::max_element(list.begin(), list.end())`), in one header shared by the traits.",
        before="static constexpr int kSmemIOSize = std::max({sizeof(typename LoadT::TempStorage), "
               "sizeof(typename StoreT::TempStorage)});",
        after="static constexpr int kSmemIOSize = constexpr_max({sizeof(typename LoadT::TempStorage), "
              "sizeof(typename StoreT::TempStorage)});",
        check=check_constexpr_minmax,
    ),
    Rule(
        "device-only-math", "error", "CUDA math function HIP declares for the device only, called from host code",
        "CUDA's math headers also define `rsqrtf`, `rcbrtf`, `sinpif`, `cospif`, `normcdff`, `erfinvf`, `rhypotf`, "
        "`norm3df` ... for the host, so nvcc accepts them in host functions and in templates a host function "
        "instantiates. HIP declares them `__device__` only: hipcc stops with 'no matching function for call to "
        "rsqrtf' (apex's ROCm port hit it in a host template specialisation).",
        "Compute it with standard functions on the host (`1.f / std::sqrt(x)`), or mark the function "
        "`__host__ __device__` and keep the call on the device side (`#ifdef __HIP_DEVICE_COMPILE__`).",
        before="template <> float rsqrt(float v) { return rsqrtf(v); }",
        after="template <> __host__ __device__ float rsqrt(float v) { return 1.f / sqrtf(v); }",
        check=check_host_math,
    ),
    Rule(
        "constexpr-device-only", "error", "`constexpr __device__` function called from host code",
        "nvcc lets host code call a `constexpr __device__` function (torch's extension flags pass "
        "`--expt-relaxed-constexpr`), so helpers such as `log2` / `roundUp256` used both in kernels and in a "
        "`static constexpr` member or a host function that sizes shared memory compile there. hip-clang keeps "
        "`__device__` strict: 'reference to __device__ function in __host__ function' (torchaudio's CTC decoder port "
        "marked them `__host__ __device__`).",
        "Mark the helper `constexpr __host__ __device__` (one definition both sides evaluate).",
        before="template <typename T> constexpr __device__ T log2(T n) { return n <= 1 ? 0 : 1 + log2(n / 2); }\n"
               "template <int N> struct Bits { static constexpr int value = log2(N); };",
        after="template <typename T> constexpr __host__ __device__ T log2(T n) { return n <= 1 ? 0 : 1 + log2(n / 2); }\n"
              "template <int N> struct Bits { static constexpr int value = log2(N); };",
        check=check_constexpr_device_calls,
    ),
    Rule(
        "missing-return", "error", "function with a return type ends without `return`",
        "Falling off the end of a function that returns a value is undefined behaviour. nvcc usually hands "
        "back whatever the return register held; clang (hipcc) treats the path as unreachable and may drop "
        "the code before it or the branches leading there, so the kernel computes garbage or hangs (mamba's "
        "ROCm port fixed a scan helper that returned nothing).",
        "Return the value on every path (`return value;`), or declare the function `void` if nothing uses it.",
        before="template <typename T> __device__ T scan_step(T* v) { v[0] += v[1]; }",
        after="template <typename T> __device__ T scan_step(T* v) { v[0] += v[1]; return v[0]; }",
        check=check_missing_return,
    ),
    Rule(
        "host-warp-size", "warning", "`C10_WARP_SIZE` (or another header's warp-size macro) in host code",
        "In a ROCm build of PyTorch, `C10_WARP_SIZE` is the wavefront size of the GPU being compiled for in "
        "device code (64 on CDNA, 32 on RDNA), but the host pass cannot know which GPU will run the kernel: "
        "launch geometry, warps per block and shared-memory sizes computed from it on the host disagree with "
        "the kernel on one of the two families (and ROCm's newer PyTorch no longer gives the host a constant). "
        "A project's own `WARP_SIZE` from a compat header is the same trap: keyed on `__GFX9__` or "
        "`__AMDGCN_WAVEFRONT_SIZE`, it reads the host pass's value (vLLM's topk softmax launched 32-wide blocks "
        "for kernels built for 64 lanes until it asked the device).",
        "Ask the device on the host: `at::cuda::warp_size()` (or `hipDeviceProp_t::warpSize`), and keep "
        "`C10_WARP_SIZE` and compile-time warp sizes for device code.",
        before="void launch(int num_warps) { const dim3 threads(C10_WARP_SIZE, num_warps); }",
        after="void launch(int num_warps) { const dim3 threads(at::cuda::warp_size(), num_warps); }",
        check=check_host_warp_size,
    ),
    Rule(
        "syncwarp", "error", "`__syncwarp`",
        "HIP has no `__syncwarp` (ROCm's headers through 6.2 at least), nor hipCUB CUB's `WARP_SYNC` macro for it: "
        "the port does not compile. The lanes of "
        "an AMD wavefront execute in lockstep, so what it guards on NVIDIA's independently scheduled lanes is "
        "already ordered; the compiler may still move shared-memory accesses across the spot.",
        "Under `USE_ROCM`, replace it by `__builtin_amdgcn_wave_barrier()` (a scheduling barrier for the "
        "wavefront), keeping `__syncwarp(mask)` for CUDA behind one macro.",
        before="__syncwarp();",
        after="#ifdef USE_ROCM\n__builtin_amdgcn_wave_barrier();\n#else\n__syncwarp();\n#endif",
        pattern=re.compile(r"\b__syncwarp\s*\(|\bcub::WARP_SYNC\s*\("),
    ),
    Rule(
        "hip-builtin-redefinition", "error", "a function HIP already defines",
        "CUDA code often brings its own `atomicMax(float*, float)` / `atomicMin(float*, float)` (an atomicCAS loop) "
        "or, for GPUs before sm_60, `atomicAdd(double*, double)` under `#if __CUDA_ARCH__ < 600` (which is true "
        "on AMD): HIP's headers define all of these, so hipcc stops with a redefinition error. And a file's own "
        "`__host__ __device__` `operator*` / `operator/` / `operator+=` ... between two `float2` / `float3` values "
        "meets HIP_vector_type's own, also `__host__ __device__` (hidden friends and members): each call of them is "
        "ambiguous. (A `__device__`-only one wins clang's same-side preference: checked with clang 15 against "
        "ROCm 6.0's headers.)",
        "Leave the definition out under `USE_ROCM` (HIP's atomics use hardware atomics where the GPU has them; its "
        "vector operators work component-wise, as the file's did).",
        before="__host__ __device__ inline float2 operator*(const float2& a, const float2& b) {\n"
               "  return make_float2(a.x * b.x, a.y * b.y);\n}",
        after="#if !defined(USE_ROCM)  // HIP's float2 has it\n__host__ __device__ inline float2 operator*(const float2& a, "
              "const float2& b) {\n  return make_float2(a.x * b.x, a.y * b.y);\n}\n#endif",
        check=check_builtin_redefinitions,
    ),
    Rule(
        "scoped-atomic", "error", "clang's `__scoped_atomic_*` builtins",
        "`__scoped_atomic_load_n`, `__scoped_atomic_store_n`, `__scoped_atomic_fetch_add` ... came with LLVM 18 "
        "(December 2023): ROCm 6.0 and 6.1 ship AMD clang 17, whose hipcc rejects them (ROCm 6.2's clang 18 has "
        "them). The GNU `__atomic_*` builtins compile everywhere but take no scope: on AMD GPUs they are system "
        "scope, stronger and slower than a device-scope flag needs.",
        "Call HIP's scoped builtins, which every ROCm >= 6.0 has: `__hip_atomic_load(p, order, scope)`, "
        "`__hip_atomic_store(p, v, order, scope)`, `__hip_atomic_fetch_add(p, v, order, scope)` ..., with "
        "`__HIP_MEMORY_SCOPE_AGENT` for `__MEMORY_SCOPE_DEVICE` and `__HIP_MEMORY_SCOPE_SYSTEM` for "
        "`__MEMORY_SCOPE_SYSTEM`.",
        before="while (!__scoped_atomic_load_n(&flag, __ATOMIC_RELAXED, __MEMORY_SCOPE_DEVICE));",
        after="while (!__hip_atomic_load(&flag, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT));",
        check=check_scoped_atomics,
    ),
    Rule(
        "discarded-status", "warning", "`cudaGetLastError();` called only to clear the error",
        "`cudaGetLastError();` as a statement resets the sticky error after an expected failure (a malloc that may "
        "fail, peer access already enabled). HIP declares `hipError_t` `[[nodiscard]]` (hip_runtime_api.h, ROCm 5.7 "
        "to 6.x, in C++17), so the translated `hipGetLastError();` warns 'ignoring return value', an error under "
        "`-Werror` (llama.cpp's hipGraph port cast eight of them).",
        "Say the status is dropped on purpose: `(void)cudaGetLastError();` (both compilers accept it).",
        before="if (cudaMallocHost(&ptr, size) != cudaSuccess) {\n  cudaGetLastError();  // clear the error\n}",
        after="if (cudaMallocHost(&ptr, size) != cudaSuccess) {\n  (void)cudaGetLastError();  // clear the error\n}",
        pattern=re.compile(r"^[ \t]*\b(?:cuda|hip)(?:GetLastError|PeekAtLastError)\s*\(\s*\)\s*;", re.MULTILINE),
    ),
    Rule(
        "rocblas-branch", "warning", "a hand-written rocBLAS branch beside cuBLAS code",
        "Until torch 2.1, torch's hipify turned cuBLAS into rocBLAS, so ports wrote `#ifdef __HIP_PLATFORM_AMD__` "
        "branches calling `rocblas_gemm_ex` on a `rocblas_handle`. torch >= 2.1's hipify (like hipify-perl and "
        "hipify-clang) turns cuBLAS into hipBLAS: `at::cuda::getCurrentCUDABlasHandle()` is then a "
        "`hipblasHandle_t`, and the hipified callers hand the branch hipBLAS handles, operations and types, which "
        "it does not take.",
        "Keep the rocBLAS branch for torch <= 2.0 only (`&& (TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && "
        "TORCH_VERSION_MINOR == 0))`), or drop it, and let the cuBLAS call be translated to hipBLAS with hipBLAS's "
        "data and compute types (`HIPBLAS_R_16F`, `HIPBLAS_COMPUTE_32F` with hipBLAS 2).",
        before="#ifdef __HIP_PLATFORM_AMD__\n  rocblas_gemm_ex(handle, ...);\n#else\n  cublasGemmEx(handle, ...);\n#endif",
        after="#if defined(__HIP_PLATFORM_AMD__) && TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 0\n"
              "  rocblas_gemm_ex(handle, ...);\n#else\n  cublasGemmEx(handle, ...);  // hipified to hipblasGemmEx\n#endif",
        check=check_rocblas_branches,
        reads_dead_code=True,
    ),
    Rule(
        "unused-thrust-header", "warning", "a Thrust header the file does not use",
        "Thrust becomes rocThrust, a separate ROCm library whose headers compile only under hipcc: an include "
        "nothing uses makes the HIP build depend on rocThrust, and breaks each file a host compiler builds that "
        "includes this one (bitsandbytes' C interface, built by g++, included its ops header).",
        "Remove the include, or move it to the file that uses Thrust.",
        before="#include <cstdint>\n#include <thrust/device_vector.h>  // nothing here names thrust::",
        after="#include <cstdint>",
        check=check_unused_thrust,
    ),
    Rule(
        "unused-nvtx-header", "warning", "an NVTX header the file does not use",
        "NVTX becomes roctx: the translation includes `roctracer/roctx.h`, a ROCm component of its own (roctracer; "
        "rocprofiler-sdk ships another roctx) whose calls link `-lroctx64`; an include nothing uses makes the HIP "
        "build need it for nothing (QUICK's HIP port dropped its `nvToolsExt.h`, whose calls "
        "were all commented out).",
        "Remove the include; where ranges are wanted on AMD, include roctx (or rocprofiler-sdk's) and link it.",
        before='#include "nvToolsExt.h"  // every nvtxRangePushA commented out',
        after="",
        check=check_unused_nvtx,
    ),
    Rule(
        "extern-c-include", "error", 'a CUDA header included inside `extern "C"`',
        "nvcc includes cuda_runtime.h before the file's first line, so a CUDA header included again inside an "
        "`extern \"C\" { ... }` block (often the file's own `foo_cuda.h`, opened with `#ifdef __cplusplus`) adds "
        "nothing there. Translated, the block includes HIP's headers, whose C++ half (hip_runtime_api.h's template "
        "overloads, hip_fp16.h's and hip_complex.h's operators) then gets C linkage: hip-clang stops at 'templates "
        "must have C++ linkage' (UCC's ROCm kernels moved their includes out of the block).",
        'Include the CUDA or HIP headers before the `extern "C"` block, and keep only C declarations inside it.',
        before='#ifdef __cplusplus\nextern "C" {\n#endif\n#include "mc_cuda.h"\n#ifdef __cplusplus\n}\n#endif',
        after='#include "mc_rocm.h"  // outside any extern "C" block',
        check=check_extern_c_includes,
    ),
    Rule(
        "bf16-arithmetic", "warning", "an arithmetic operator on two bf16 values",
        "ROCm 6.0's `__hip_bfloat16` is a plain struct without arithmetic operators (ROCm 6.1's hip_bf16.h added "
        "them): `a + b` on two `__nv_bfloat16` values does not compile there. vLLM's port wrote `__hadd(a, b)`.",
        "Call the intrinsic (`__hadd`, `__hsub`, `__hmul`, `__hdiv`; `__hadd2` ... for `__nv_bfloat162`), which "
        "both compilers have, or compute in float (`__bfloat162float`).",
        before="__device__ __nv_bfloat16 add(__nv_bfloat16 a, __nv_bfloat16 b) { return a + b; }",
        after="__device__ __nv_bfloat16 add(__nv_bfloat16 a, __nv_bfloat16 b) { return __hadd(a, b); }",
        check=check_bf16_arithmetic,
    ),
    Rule(
        "register-storage", "error", "the `register` storage class",
        "`register` was deprecated in C++11 and removed in C++17. clang, which hipcc is, rejects it in C++17 mode "
        "(\"ISO C++17 does not allow 'register' storage class specifier\", an error by default), and torch "
        "extensions build with -std=c++17; nvcc accepts it and g++ only warns, so the CUDA build never said.",
        "Drop the keyword (compilers ignore it), or spell it through a macro that is `register` only before C++17. "
        "A HIP build that compiles an older standard (`tiletune hipify --std c++11`, as SHOC's `-std=c++11`) only "
        "gets clang's deprecation warning: nothing fires.",
        before="register int r1, r2, r3, r4;",
        after="int r1, r2, r3, r4;",
        check=check_register_storage,
        reads_build=True,
    ),
    Rule(
        "warpsize-constexpr", "error", "`warpSize` where C++ needs a constant",
        "HIP declared `warpSize` `static constexpr` up to ROCm 6.x, so ports sized shared arrays and template "
        "arguments by it; ROCm 7.0 makes it a value read at run time (one binary for wave32 and wave64 targets), "
        "and those declarations stop compiling. CUDA's `warpSize` never was a constant.",
        "Use a compile-time width that follows the target: `C10_WARP_SIZE` in a torch extension (64 under "
        "`__GFX9__`, 32 otherwise), or a project macro on `__GFX9__` / `__AMDGCN_WAVEFRONT_SIZE__`; keep `warpSize` "
        "for run-time arithmetic.",
        before="__shared__ float smem[THREADS_PER_CTA / warpSize];",
        after="__shared__ float smem[THREADS_PER_CTA / C10_WARP_SIZE];",
        check=check_constexpr_warp_size,
    ),
    Rule(
        "warp-size-assert", "error", "a check that the warp is 32 lanes (`static_assert`, or the sizes a run-time test accepts)",
        "The code after it was written for 32 lanes (a bitonic network of five stages, a 32-bit lane mask, 32 "
        "slots per warp). On a 64-lane wavefront (CDNA: MI200, MI300) the assert stops the build once the "
        "warp-size constant follows the target, and where the constant stays 32 the code compiles but covers "
        "half of each wavefront.",
        "Make the code generic in the warp size (a stage or slot per power of two up to it, `if constexpr` on "
        "64), then assert what it supports: `static_assert(kWarpSize == 32 || kWarpSize == 64)`.",
        before="static_assert(kWarpSize == 32, \"unexpected warp size\");",
        after="static_assert(kWarpSize == 32 || kWarpSize == 64, \"unexpected warp size\");",
        check=check_warp_size_asserts,
    ),
    Rule(
        "device-std-clamp", "error", "`std::clamp` in device code",
        "libstdc++ 14 (gcc 14: Ubuntu 24.04, Fedora 40) checks `std::clamp`'s bounds with `__glibcxx_assert`, which "
        "calls a host function; hipcc compiles device code against the host's libstdc++ and stops with \"reference "
        "to __host__ function in __device__ function\" (vLLM #13777; clang's later fix: llvm-project #136133). nvcc "
        "builds against the same headers but never instantiates the assertion in device code.",
        "Write the clamp out: `v < lo ? lo : (hi < v ? hi : v)`, or `fminf(fmaxf(v, lo), hi)` for floats.",
        before="__device__ int8_t to_int8(float x) { return std::clamp(x, -128.f, 127.f); }",
        after="__device__ int8_t to_int8(float x) { return fminf(fmaxf(x, -128.f), 127.f); }",
        check=check_device_std_clamp,
    ),
    Rule(
        "device-std-throw", "error", "a throwing standard-library member in device code",
        "`std::array::at` / `std::vector::at` check the index and `std::optional::value` the presence through "
        "libstdc++'s `__throw_out_of_range_fmt` / `__throw_bad_optional_access`, host functions. nvcc accepts the "
        "constexpr members in device code (--expt-relaxed-constexpr); hip-clang stops with \"reference to __host__ "
        "function in __host__ __device__ function\" (gsplat's ROCm port, torchao's tiled layout).",
        "Index without the check (`a[i]`), and test an optional before reading it (`if (o) { ... *o ... }`).",
        before="struct Params { std::array<float, 6> poly; };\n"
               "__host__ __device__ float slope(const Params& p) { return p.poly.at(1); }",
        after="struct Params { std::array<float, 6> poly; };\n"
              "__host__ __device__ float slope(const Params& p) { return p.poly[1]; }",
        check=check_device_std_throw,
    ),
    Rule(
        "device-std-printf", "error", "`std::printf` in device code",
        "`std::printf` is libstdc++'s `using ::printf`: the host C library's function. nvcc accepts it in device code; "
        "hip-clang stops with \"reference to __host__ function 'printf' in __global__ function\" (checked with hipcc "
        "5.2): HIP's device printf is the global `printf` (rccl-tests' port made that edit).",
        "Call `printf(...)` in device code.",
        before="__global__ void dump(const float* x) { if (threadIdx.x == 0) std::printf(\"%f\\n\", x[0]); }",
        after="__global__ void dump(const float* x) { if (threadIdx.x == 0) printf(\"%f\\n\", x[0]); }",
        check=check_device_std_printf,
    ),
    Rule(
        "device-ctad", "error", "class template argument deduction of a standard type in device code",
        "`std::array{1, 2}` (no template arguments) deduces them through a deduction guide, which hip-clang takes "
        "for a host function: \"reference to __host__ function '<deduction guide for array>' in __host__ __device__ "
        "function\" (checked with hipcc 5.2). nvcc accepts it.",
        "Spell the arguments out: `std::array<int64_t, 3>{...}`, `std::pair<int, float>(a, b)`.",
        before="__host__ __device__ int rank() { constexpr auto dims = std::array{1, 2, 3}; return dims.size(); }",
        after="__host__ __device__ int rank() { constexpr auto dims = std::array<int, 3>{1, 2, 3}; return dims.size(); }",
        check=check_device_ctad,
    ),
    Rule(
        "spaced-kernel-launch", "error", "a kernel launch with its chevrons split by spaces",
        "nvcc's front end takes `kernel << <grid, block >> > (args)` (a formatter's spacing); clang lexes `<<<` and "
        "`>>>` as launch tokens only unbroken, so hipcc parses a shift and stops with \"expected expression\" "
        "(checked with hipcc 5.2), and torch's hipify, which looks for `<<<`, leaves the launch as it is.",
        "Write the launch unbroken: `kernel<<<grid, block>>>(args)`.",
        before="renderCUDA<NUM_CHANNELS> << <grid, block >> > (ranges, out);",
        after="renderCUDA<NUM_CHANNELS><<<grid, block>>>(ranges, out);",
        check=check_spaced_launches,
    ),
    Rule(
        "grid-constant", "error", "`__grid_constant__` on a kernel parameter",
        "`__grid_constant__` (CUDA 11.7: a const by-value kernel parameter whose address may be taken without a "
        "copy) has no HIP counterpart: hipcc reads it as an unknown type name and the kernel's signature does not "
        "compile (checked with hipcc 5.2; ROCm/clr's headers through 6.2 define no such macro). AMD kernel arguments "
        "already live in the read-only kernarg segment.",
        "Drop it on AMD: `#if defined(__HIPCC__)` `#define __grid_constant__` `#endif` once, or remove it.",
        before="__global__ void decode(const __grid_constant__ Params params);",
        after="__global__ void decode(const Params params);",
        pattern=re.compile(r"\b__grid_constant__\b"),
    ),
    Rule(
        "ffs-ballot", "error", "`__ffs` of a ballot mask",
        "A ballot is 64 bits on AMD (`__ballot`, a tile's `ballot`: `unsigned long long`), and HIP declares "
        "`__ffs(int)` and `__ffs(unsigned int)` only: the call is ambiguous and does not compile (checked with hipcc "
        "5.2). A cast to 32 bits compiles but drops lanes 32-63 of a 64-lane wavefront.",
        "Use `__ffsll` on the 64-bit mask (lane = `__ffsll(mask) - 1`), which is right for 32 and 64 lanes.",
        before="int lane = __ffs(__ballot_sync(mask, key == probe)) - 1;",
        after="int lane = __ffsll(__ballot(key == probe)) - 1;",
        pattern=re.compile(r"\b__ffs\s*\(\s*(?:static_cast\s*<[^>]*>\s*\(\s*)?[\w.\->]*?"
                           r"(?:__ballot(?:_sync)?|\bballot|__activemask)\s*\("),
    ),
    Rule(
        "vector-partial-init", "error", "a vector type braced from fewer values than it has members",
        "CUDA's `float3` is an aggregate: `float3 v = {a, b}` leaves `z` zero. HIP's is `HIP_vector_type<float, 3>`, "
        "whose constructors take one value (explicit, so `float4 v = {a}` is refused too) or all of them: \"no "
        "matching constructor for initialization of 'float3'\" (checked with hipcc 5.2).",
        "Give every member: `float3 v = {a, b, 0.f}`, or `make_float3(a, b, 0.f)`.",
        before="float3 v_ndc = {0.5f * w * v.x, 0.5f * h * v.y};",
        after="float3 v_ndc = {0.5f * w * v.x, 0.5f * h * v.y, 0.f};",
        check=check_vector_partial_init,
    ),
    Rule(
        "vector-designated-init", "error", "a vector or complex value braced with designated members (`{.x = a, .y = b}`)",
        "CUDA's `double2` (and `cuDoubleComplex`, a `double2`) is an aggregate, so C++20's designated initialisers "
        "name its members. HIP's is `HIP_vector_type<double, 2>`, a class with constructors, not an aggregate: "
        "hip-clang refuses `{.x = re, .y = im}` for it (QuEST's HIP port replaced each one).",
        "Construct it: `make_double2(re, im)`, `make_hipDoubleComplex(re, im)` (`make_cuDoubleComplex` before the "
        "translation), or `double2{re, im}` with every member.",
        before="__host__ __device__ cuDoubleComplex pack(double re, double im) { return {.x = re, .y = im}; }",
        after="__host__ __device__ cuDoubleComplex pack(double re, double im) { return make_cuDoubleComplex(re, im); }",
        pattern=re.compile(r"\{\s*\.[xyzw]\s*="),
    ),
    Rule(
        "uninit-shuffle", "warning", "a lane-0 broadcast of a value the other lanes never set",
        "`T pos; if (lane == 0) pos = atomicAdd(...); pos = tile.shfl(pos, 0);` reads an uninitialised value in the "
        "other lanes; ROCm 6.2's compiler folded that undefined input and miscompiled the broadcast (its known issue "
        "'Incorrect compilation with uninitialized parameters in __shfl', fixed in 6.3; ROCm/clr#146; DGL's port "
        "initialises it). nvcc compiles the pattern as meant.",
        "Initialise the variable where it is declared: `T pos = 0;`.",
        before="__device__ size_t claim(Tile tile, size_t* count) {\n  size_t pos;\n"
               "  if (tile.thread_rank() == 0) pos = atomicAdd(count, 1);\n  return tile.shfl(pos, 0);\n}",
        after="__device__ size_t claim(Tile tile, size_t* count) {\n  size_t pos = 0;\n"
              "  if (tile.thread_rank() == 0) pos = atomicAdd(count, 1);\n  return tile.shfl(pos, 0);\n}",
        check=check_uninitialised_broadcast,
    ),
    Rule(
        "cg-missing-api", "error", "a cooperative-groups API HIP does not have",
        "HIP's cooperative groups (amd_hip_cooperative_groups.h, checked through ROCm 6.2) have tiles and their "
        "shuffles, but no `<cooperative_groups/reduce.h>` (`cg::reduce`, `cg::plus`, `cg::greater`), no scans, no "
        "`labeled_partition`, no `memcpy_async` / `wait` and no `invoke_one`; a tile's votes (`any`, `all`, "
        "`ballot`, `match_any`, `match_all`) and `binary_partition` came in ROCm 6.3 (clr's SWDEV-450109): the port "
        "does not compile (on ROCm 6.0-6.2 for the latter).",
        "Reduce with the tile's own shuffles (`for (int o = g.size() / 2; o > 0; o /= 2) v += g.shfl_xor(v, o);`), "
        "vote with the wavefront's `__any` / `__all` / `__ballot` (a tile narrower than the wavefront: mask the "
        "ballot to its lanes), and copy to shared memory with plain loads.",
        before="#include <cooperative_groups/reduce.h>\nv = cg::reduce(warp, v, cg::plus<float>());",
        after="for (int o = warp.size() / 2; o > 0; o /= 2) v += warp.shfl_xor(v, o);",
        check=check_cooperative_groups_api,
    ),
    Rule(
        "builtin-index-narrowing", "error", "a built-in index narrowed in a braced initialiser",
        "`threadIdx.x` and its kin are `unsigned int`; list-initialising an `int` or a `float` from one "
        "(`Reduce({threadIdx.x, gain}, cub::ArgMax())` into a `KeyValuePair<int, float>`) is a narrowing "
        "conversion, which nvcc and g++ only warn about and clang (hipcc) rejects: \"non-constant-expression cannot "
        "be narrowed\" (checked with hipcc 5.2).",
        "Cast it: `{static_cast<int>(threadIdx.x), gain}`.",
        before="auto best = Reduce(storage).Reduce({threadIdx.x, gain}, cub::ArgMax());",
        after="auto best = Reduce(storage).Reduce({static_cast<int>(threadIdx.x), gain}, cub::ArgMax());",
        check=check_builtin_index_narrowing,
    ),
    Rule(
        "auto-builtin-index", "warning", "`auto` copy of a built-in index that is then changed",
        "Up to ROCm 6.0 HIP's `blockIdx.y` (and its kin) is a proxy object that converts to `unsigned`: `auto i = "
        "blockIdx.y` copies the proxy, ROCm 5.2 gives it no `+=` (a compile error, checked with hipcc 5.2) and "
        "ROCm 5.3-6.0 a `+=` that leaves `i` unchanged, so a grid-stride loop never advances. ROCm 6.1 made the "
        "indices plain `unsigned` properties (ROCm/clr 638f9a7c0, c4ae8be65).",
        "Declare the type: `for (int i = blockIdx.y; i < n; i += gridDim.y)`.",
        before="for (auto i = blockIdx.y; i < rows; i += gridDim.y) { ... }",
        after="for (unsigned i = blockIdx.y; i < rows; i += gridDim.y) { ... }",
        check=check_auto_builtin_index,
    ),
    Rule(
        "device-link", "warning", "a `__device__` function defined in another file",
        "The file declares a `__device__` function whose body is in another translation unit. nvcc links such "
        "calls with relocatable device code (`-rdc=true`, CMake's CUDA_SEPARABLE_COMPILATION); a HIP build links "
        "device code across files only with `-fgpu-rdc` (slower to build, and torch's extension builder does "
        "not pass it), else the link stops at an undefined device symbol.",
        "Define the function in the header (`__device__ inline` or a template), or build with `-fgpu-rdc` and link "
        "with it too.",
        before="template <typename T> __device__ T percentile(const T* v, int n);  // defined in algorithms.cu",
        after="template <typename T> __device__ T percentile(const T* v, int n) { ... }  // in the header",
        check=check_device_declarations,
    ),
    Rule(
        "missing-intrinsic", "error", "CUDA intrinsic HIP does not have",
        "HIP lacks CUDA's SIMD-within-a-word and dot-product intrinsics (`__dp4a`, `__dp2a_lo`, `__vsubss4`, "
        "`__vabsdiffs4`, ...), `__nanosleep`, the `__reduce_*_sync` warp reductions, the cache-hinted loads and "
        "stores `__ldlu`, `__ldcv`, `__stwb`, `__stcg`, `__stcs`, `__stwt` (and `__ldcs` / `__ldcg` / `__ldca` but "
        "for `__half` / `__half2`), the block-scope atomics (`atomicAdd_block`, ...), `__double2half`, "
        "`__cvta_generic_to_shared`, `make_bfloat162` and the integer <-> bf16 conversions (`__int2bfloat16_rn`, "
        "`__bfloat162int_rn`: none in HIP's headers through ROCm 6.2), the float -> bf16 conversions that name their "
        "rounding (`__float2bfloat16_rn`, `__floats2bfloat162_rn`, `__float2bfloat162_rn`: none through ROCm 7), "
        "CUDA 12's `atomicAdd` on `float2` / `float4` (sm_90), `atomicAdd` on "
        "`__half` / `__half2` (only `unsafeAtomicAdd(__half2*, __half2)`, gfx90a and later) and a 16-bit "
        "`atomicCAS` (clr's amd_hip_atomic.h overloads int, unsigned int, the 64-bit integers, float and double "
        "only): the port does not compile.",
        "Write a small polyfill under `USE_ROCM`: `__builtin_amdgcn_sdot4` (gfx9xx: gfx906, gfx90a, gfx942) or "
        "`__builtin_amdgcn_sudot4` (gfx11) for `__dp4a`, `__builtin_elementwise_sub_sat` on a char4 for "
        "`__vsubss4`, a shuffle reduction for `__reduce_add_sync`, a plain load or store for a cache hint "
        "(`*ptr`; `__builtin_nontemporal_load` / `_store` for a streaming one), an atomicCAS loop on the 32-bit "
        "word for a half atomicAdd or a 16-bit compare-and-swap, one float atomicAdd per component for a float2 / "
        "float4 one; HIP's exact equivalents of the bf16 conversions (its `__float2bfloat16` rounds to nearest "
        "even): `__float2bfloat16(x)`, `__float22bfloat162_rn(make_float2(a, b))`, "
        "`__bfloat162bfloat162(__float2bfloat16(x))`, which the torch engine writes.",
        before="acc = __dp4a(a, b, acc);",
        after="acc = __builtin_amdgcn_sdot4(a, b, acc, false);  // gfx9xx; __dp4a on CUDA",
        check=check_missing_intrinsics,
    ),
    Rule(
        "ldg-torch-half", "error", "`__ldg` on torch's Half",
        "torch declares `__ldg(const c10::Half*)` only for nvcc and clang-CUDA (c10's Half.h: `__CUDA_ARCH__ >= 350` "
        "or `__clang__ && __CUDA__`, still so in torch 2.13), and HIP's own `__ldg` overloads take builtin types and "
        "`__half`: a kernel that loads `scalar_t` through `__ldg` and is dispatched for Half has no matching call "
        "under hipcc.",
        "Load through a macro that is `__ldg(p)` on CUDA and a plain `*(p)` under `USE_ROCM` (AMD's loads go through "
        "the same cache either way).",
        before="template <typename scalar_t>\n__global__ void k(const scalar_t* __restrict__ x, scalar_t* y) {\n"
               "  y[threadIdx.x] = __ldg(&x[threadIdx.x]);\n}",
        after="#ifdef USE_ROCM\n#define LDG(p) (*(p))\n#else\n#define LDG(p) __ldg(p)\n#endif\n"
              "template <typename scalar_t>\n__global__ void k(const scalar_t* __restrict__ x, scalar_t* y) {\n"
              "  y[threadIdx.x] = LDG(&x[threadIdx.x]);\n}",
        check=check_ldg_torch_half,
    ),
    Rule(
        "half-raw-bits", "error", "`__half_raw` / `__half2_raw` braced from bit patterns",
        "CUDA's `__half_raw` is a struct holding the 16 bits (`unsigned short x`), so `__half_raw inf = {0x7C00}` "
        "is +inf. HIP's is a union whose first member is the `_Float16` value, so the same braces give the "
        "number 31744.0 (and `__half2_raw` a vector of such numbers): compiled without a warning, wrong at run time.",
        "Name the bits: `__half_raw inf; inf.x = 0x7C00;` (HIP's union has `x` as well), or write the value "
        "(`__ushort_as_half(0x7C00)`, `__half(INFINITY)`).",
        before="constexpr __half_raw inf = {0x7C00};",
        after="__half_raw inf;\ninf.x = 0x7C00;",
        pattern=re.compile(r"\b__half2?_raw\s+\w+\s*=\s*\{[^}]*?\b(?:0[xX]0*[1-9a-fA-F][0-9a-fA-F]*|[1-9]\d*)[uU]?\b"),
    ),
    Rule(
        "half-brace-assign", "error", "`= {}` assigned to a `__half` / `__half2`",
        "HIP's `__half` and `__half2` have copy and move assignment and an assignment from `__half_raw` / "
        "`__half2_raw`; an empty brace list matches all of them, so hipcc stops with 'use of overloaded operator "
        "'=' is ambiguous' (nvcc accepts it). AutoGPTQ's port zeroed its accumulators another way.",
        "Assign a value: `h2 = __float2half2_rn(0.f);` (or `h = __float2half(0.f);`), which both compilers take.",
        before="__half2 acc;\nacc = {};",
        after="__half2 acc;\nacc = __float2half2_rn(0.f);",
        check=check_half_brace_assign,
    ),
    Rule(
        "libcudacxx", "warning", "libcu++ (`<cuda/std/...>`, `cuda::std::`)",
        "libcu++ ships with the CUDA toolkit and CCCL; ROCm has no `<cuda/std/...>` headers (libhipcxx is a "
        "separate, partial port) and no translator maps them, so the include fails or `cuda::std::` is unknown.",
        "Use the standard library (`<type_traits>`, `std::`), which hipcc accepts in device code for "
        "constexpr facilities, or alias it under `#if defined(USE_ROCM)`: `namespace cuda { namespace std = ::std; }`.",
        before="#include <cuda/std/type_traits>\nusing U = cuda::std::remove_cv_t<T>;",
        after="#include <type_traits>\nusing U = std::remove_cv_t<T>;",
        check=check_libcudacxx,
    ),
    Rule(
        "cuda-arch-guard", "warning", "`__CUDA_ARCH__` version test",
        "`__CUDA_ARCH__` is not defined when hipcc compiles for AMD, so `#if __CUDA_ARCH__ >= 800` "
        "silently selects the fallback (or the host-only) branch: fast paths disappear without an error. A macro "
        "defined as such a test (`#define HAS_BF16 (__CUDA_ARCH__ >= 800)`) is false on AMD wherever it is tested. "
        "The lint reads the code under a bare `#ifdef __CUDA_ARCH__` (the device pass, which the port keeps as "
        "`__HIP_DEVICE_COMPILE__`) and skips what a version test compiles out: lint again after enabling such a branch.",
        "Test `__HIP_DEVICE_COMPILE__` / `__HIP_PLATFORM_AMD__` (and `__gfx942__` etc.) explicitly for the AMD path.",
        before="#if __CUDA_ARCH__ >= 800",
        after="#if defined(__gfx90a__) || defined(__gfx942__)  // the AMD path, then the __CUDA_ARCH__ tests",
        check=check_arch_guards,
        reads_dead_code=True,
        reads_build=True,
    ),
    Rule(
        "cuda-build-flag", "warning", "GPU code under a CUDA build flag the HIP build does not set",
        "Projects select their GPU code with a build flag of their own (`#ifdef WITH_CUDA`); a ROCm build that "
        "defines its own flag instead (`WITH_ROCM`, `USE_ROCM`) compiles that code out, and the op answers 'not "
        "compiled with GPU support' at run time (bevfusion's and bitsandbytes' ROCm ports widened the tests). Fires "
        "where the HIP build is known to leave the flag undefined: `tiletune hipify -U WITH_CUDA`.",
        "Widen the test to the HIP build's flag (`#if defined(WITH_CUDA) || defined(WITH_ROCM)`), or define the "
        "CUDA flag in the HIP build too.",
        before="// hip-build: -D WITH_ROCM -U WITH_CUDA\n"
               "#ifdef WITH_CUDA\nint hard_voxelize_gpu(const at::Tensor& points);\n#endif",
        after="#if defined(WITH_CUDA) || defined(WITH_ROCM)\nint hard_voxelize_gpu(const at::Tensor& points);\n#endif",
        check=check_cuda_build_flags,
        reads_dead_code=True,
        reads_build=True,
    ),
    Rule(
        "compiler-guard", "warning", "`__NVCC__`, GCC-version or old-CUDA test",
        "`__NVCC__` (and `__CUDACC_VER_MAJOR__`, tested for being defined) is nvcc's own macro: hipcc never defines it "
        "and no translator renames it (torch's hipify renames `__CUDACC__`, not `__NVCC__`). And hipcc's clang reports `__GNUC__` 4, so `#if __GNUC__ < 6` (an "
        "old-host-compiler escape) is taken. Code under such tests is compiled out on AMD, or an `#else` meant for "
        "other compilers is taken: `__host__ __device__` qualifiers chosen there vanish (device code calling the "
        "helpers stops compiling), or a whole op is built empty. CUDA's version macros are undefined under hipcc "
        "(torch's hipify makes `CUDA_VERSION` TORCH_HIP_VERSION, about 600): an old-toolkit escape such as "
        "`#if CUDA_VERSION < 9000` / `#error` is taken (faiss's ROCm port moved its into the CUDA branch), and a "
        "feature under `#if CUDART_VERSION >= 12000` is compiled out, its `#else` stubs built (FBGEMM's fp8 quantize). "
        "An older port's `#ifdef __HIP_PLATFORM_HCC__` fails the same way: ROCm's headers defined that hcc-era macro "
        "up to 5.7, and ROCm 6.0 (and torch 2.3's extension flags) dropped it, so the AMD branch is silently compiled "
        "out (torchvision's deform_conv2d lost its 256-thread ROCm launch until #8070).",
        "Test `defined(__NVCC__) || defined(__HIPCC__)` where the branch is about CUDA-style compilers, keep "
        "host-compiler and CUDA-toolkit version checks out of `__HIPCC__` builds, and test `__HIP_PLATFORM_AMD__` "
        "(or `USE_ROCM`) where `__HIP_PLATFORM_HCC__` stood.",
        before="#ifdef __NVCC__\n#define HD __host__ __device__\n#else\n#define HD\n#endif",
        after="#if defined(__NVCC__) || defined(__HIPCC__)\n#define HD __host__ __device__\n#else\n#define HD\n#endif",
        check=check_compiler_guards,
        reads_dead_code=True,
    ),
    Rule(
        "cuda-version-expression", "error", "CUDA toolkit version read in C++ code",
        "nvcc defines `__CUDACC_VER_MAJOR__` / `_MINOR__` / `_BUILD__` and cuda_runtime_api.h `CUDART_VERSION`; "
        "hipcc defines neither (hipify-perl renames `CUDART_VERSION` to `HIPRT_VERSION`, which HIP does not define "
        "either; torch's hipify and `tiletune hipify` leave both). In "
        "an `#if` an undefined name reads 0 (`compiler-guard` says where that compiles code out); in C++ code it is an "
        "undeclared identifier: `static_assert(__CUDACC_VER_MAJOR__ > 10, \"needs CUDA 10.2\")` or `return "
        "CUDART_VERSION;` stops the build.",
        "Keep the check for CUDA builds (`#if defined(__CUDACC__) && !defined(__HIPCC__)` around it), or report "
        "`HIP_VERSION` (hip_version.h) on AMD.",
        before="static_assert(__CUDACC_VER_MAJOR__ > 10, \"requires CUDA 10.2\");",
        after="#if !defined(__HIPCC__)\nstatic_assert(__CUDACC_VER_MAJOR__ > 10, \"requires CUDA 10.2\");\n#endif",
        check=check_cuda_version_expressions,
    ),
    Rule(
        "void-pointer-arith", "error", "arithmetic on a `void*`",
        "g++ (nvcc's host compiler) accepts `p + n` on a `void*` as a GNU extension; clang, which hipcc is, "
        "rejects it in C++ (\"arithmetic on a pointer to void\", checked with hipcc 5.2).",
        "Declare the pointer `char*` (or cast: `static_cast<char*>(p) + n`).",
        before="void swap(torch::Tensor& t, char* dst, int64_t offset) {\n  void* src = t.data_ptr();\n  copy(dst, src + offset);\n}",
        after="void swap(torch::Tensor& t, char* dst, int64_t offset) {\n  char* src = static_cast<char*>(t.data_ptr());\n"
              "  copy(dst, src + offset);\n}",
        check=check_void_pointer_arithmetic,
    ),
    Rule(
        "smem-optin-zero", "error", "the opt-in shared-memory limit, which HIP reports as 0",
        "`cudaDevAttrMaxSharedMemoryPerBlockOptin` (`sharedMemPerBlockOptin`) maps to "
        "`hipDeviceAttributeSharedMemPerBlockOptin`, which ROCm 6.0 to 6.2 set to 0 (clr's hip_device.cpp): "
        "code that sizes shared memory by it gets nothing, and launches or whole ops are refused.",
        "Read `hipDeviceAttributeMaxSharedMemoryPerBlock` under `USE_ROCM` (AMD has no opt-in beyond it: 64 KiB).",
        before="cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);",
        after="#ifdef USE_ROCM\ncudaDeviceGetAttribute(&smem, hipDeviceAttributeMaxSharedMemoryPerBlock, dev);\n#else\n"
              "cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);\n#endif",
        # or a project's helper named for it (xgboost's dh::MaxSharedMemoryOptin)
        pattern=re.compile(r"\bcudaDevAttrMaxSharedMemoryPerBlockOptin\b|\bsharedMemPerBlockOptin\b"
                           r"|\b\w*(?i:shared_?mem\w*opt_?in)\w*\s*\("),
    ),
    Rule(
        "launch-attribute-missing", "error", "a launch attribute HIP does not have (programmatic dependent launch, clusters)",
        "HIP's `hipLaunchAttributeID` (ROCm 6.2 and later) holds the access-policy window, cooperative, "
        "synchronization-policy, priority and memory-sync-domain attributes only: no programmatic dependent launch "
        "(`cudaLaunchAttributeProgrammaticStreamSerialization`, `...ProgrammaticEvent`, the device's "
        "`cudaGridDependencySynchronize()` / `cudaTriggerProgrammaticLaunchCompletion()`), no thread-block "
        "clusters, no launch-completion event: the port does not compile.",
        "Under `USE_ROCM` launch with `<<<grid, block, smem, stream>>>` (the stream orders the kernels anyway) and "
        "drop the device-side dependency calls.",
        before="attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;\n"
               "attrs[0].val.programmaticStreamSerializationAllowed = enable_pdl;\n"
               "cudaLaunchKernelEx(&config, kernel, x, y, n);",
        after="#ifdef USE_ROCM\nkernel<<<grid, block, 0, stream>>>(x, y, n);\n#else\n"
              "attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;\n"
              "attrs[0].val.programmaticStreamSerializationAllowed = enable_pdl;\n"
              "cudaLaunchKernelEx(&config, kernel, x, y, n);\n#endif",
        pattern=re.compile(r"\bcudaLaunchAttribute(?:ProgrammaticStreamSerialization|ProgrammaticEvent|ClusterDimension"
                           r"|PreferredClusterDimension|ClusterSchedulingPolicyPreference|LaunchCompletionEvent"
                           r"|DeviceUpdatableKernelNode|PreferredSharedMemoryCarveout)\b"
                           r"|\bprogrammaticStreamSerializationAllowed\b"
                           r"|\b(?:cudaGridDependencySynchronize|cudaTriggerProgrammaticLaunchCompletion)\s*\("),
    ),
    Rule(
        "nvrtc-option", "warning", "an NVRTC-only compile option",
        "hipify makes NVRTC hiprtc, which compiles with clang for the GPU the process runs on: a virtual architecture "
        "(`-arch=compute_80`) means nothing to it; it has no `--device-as-default-execution-space` (functions the JIT "
        "source leaves unannotated stay host functions, and the kernel's calls to them stop compiling) and takes clang's "
        "`-ffast-math` for `--use_fast_math` (Bifrost's hipify branch, libCEED's HIP backend). What it returns is an AMD "
        "code object, not PTX text (`code-object-text`).",
        "Under HIP pass `--gpu-architecture=` with `hipDeviceProp_t::gcnArchName` (or no architecture), mark the JIT "
        "headers' functions `__host__ __device__` and use `-ffast-math`.",
        before='options.push_back("-arch=compute_" + std::to_string(major * 10 + minor));\n'
               'options.push_back("--device-as-default-execution-space");\n'
               'nvrtcCompileProgram(program, options.size(), options.data());\nnvrtcGetPTX(program, ptx);',
        after='options.push_back(std::string("--gpu-architecture=") + prop.gcnArchName);\n'
              'hiprtcCompileProgram(program, options.size(), options.data());\n'
              'std::vector<char> code(size);  hiprtcGetCode(program, code.data());',
        check=check_nvrtc_options,
    ),
    Rule(
        "code-object-text", "error", "the run-time compiler's output handled as a C string",
        "hipify makes `nvrtcGetPTX` `hiprtcGetCode`, whose output is an AMD code object: a binary ELF full of NUL bytes, "
        "not PTX's NUL-terminated text. Kept in a `char*` that is then printed or assigned to a `std::string`, or "
        "passed on as `ptx.c_str()` to a function that takes a C string, it is cut at its first NUL, and "
        "`hipModuleLoadData` rejects the stub (Bifrost's map kernels).",
        "Keep the code object as bytes with its size from `hiprtcGetCodeSize` (`std::vector<char>`, or a `std::string` "
        "built from the range), and pass that container, not `c_str()`, up to `hipModuleLoadData`.",
        before='std::vector<char> buf(size);\nchar* ptx = &buf[0];\nnvrtcGetPTX(program, ptx);\n*ptx_string = ptx;',
        after='std::vector<char> code(size);\nhiprtcGetCode(program, code.data());\n*code_string = {code.begin(), code.end()};',
        check=check_code_object_text,
    ),
    Rule(
        "cuda-library-dlopen", "error", "an NVIDIA library loaded by name at run time",
        "`dlopen(\"libcuda.so\")` (or libnvrtc, libcublas, nvcuda.dll) and the `dlsym` of its `cu*` symbols: no "
        "translation touches a string, and a ROCm machine has no such library, so the load fails at run time "
        "(the error path or a null function pointer).",
        "Under `USE_ROCM` load `libamdhip64.so` and its `hip*` symbols (`hipCtxGetDevice` for `cuCtxGetDevice`), "
        "or call the HIP runtime directly: HIP needs no lazy driver loading.",
        before='cudalib = dlopen("libcuda.so", RTLD_LAZY);\npfn = (PFN_cuCtxGetDevice) dlsym(cudalib, "cuCtxGetDevice");',
        after='#ifdef USE_ROCM\nhipCtxGetDevice(&device);\n#else\ncudalib = dlopen("libcuda.so", RTLD_LAZY);\n'
              'pfn = (PFN_cuCtxGetDevice) dlsym(cudalib, "cuCtxGetDevice");\n#endif',
        pattern=re.compile(r"\b(?:dlopen|LoadLibrary[AW]?)\s*\(\s*\"(?:lib)?(?:cuda|nvcuda|nvrtc|cublas\w*|cudnn\w*|"
                           r"cusparse\w*|cufft\w*|curand\w*|nvidia-ml|nvml)\b[^\"]*\""
                           r"|\b(?:dlsym|GetProcAddress)\s*\([^,()]+,\s*\"cu[A-Z]\w*\""),
    ),
    Rule(
        "device-clock", "warning", "`clock64()` measures a timeout or a duration",
        "On AMD GPUs `clock64()` reads the shader clock's cycle counter (`s_memtime` on CDNA), whose frequency follows the "
        "GPU's power management, so a timeout written in cycles (tuned on an NVIDIA GPU's clock) fires after a "
        "different, varying wall time, and durations in cycles do not convert to seconds. HIP adds `wall_clock64()`, "
        "a counter at the constant rate `hipDeviceAttributeWallClockRate` (kHz) gives.",
        "Use `wall_clock64()` under `__HIP_PLATFORM_AMD__` for timeouts and timing, with the limit converted from "
        "the wall-clock rate; keep `clock64()` only for counting cycles.",
        before="auto start = clock64();\nwhile (!ready()) if (clock64() - start > kTimeoutCycles) trap();",
        after="auto start = wall_clock64();\nwhile (!ready()) if (wall_clock64() - start > kTimeoutTicks) trap();",
        pattern=re.compile(r"\bclock64\s*\(\s*\)"),
    ),
    Rule(
        "nvshmem", "error", "NVSHMEM",
        "NVSHMEM is NVIDIA's: ROCm has neither its headers nor its library, so the include and every `nvshmem*` "
        "call fail to compile. AMD's counterpart is rocSHMEM (`rocshmem/rocshmem.hpp`, namespace `rocshmem`, "
        "`rocshmem_*` names), with its own coverage: wavefront and work-group variants (`_wave`, `_wg`) in place of "
        "`_warp` / `_block`, and nothing of NVSHMEM's internals (`nvshmemi_*`, the IBGDA device state).",
        "Put the calls behind one wrapper of neutral names that maps to NVSHMEM or rocSHMEM per platform, and "
        "rewrite what uses NVSHMEM internals.",
        before="#include <nvshmem.h>\nnvshmemx_barrier_all_block();",
        after="#include <rocshmem/rocshmem.hpp>\nif (threadIdx.x == 0) rocshmem::rocshmem_barrier_all();",
        check=check_nvshmem,
    ),
    Rule(
        "cub-internal", "error", "a CUB or Thrust internal that hipCUB / rocThrust lack",
        "hipCUB reproduces CUB's public interface only: the specialisations CUB builds it from "
        "(`cub::WarpReduceShfl`, `WarpScanShfl` and its `Update`, `BlockReduceRaking`...) have no `hipcub::` "
        "counterpart, and rocThrust has no CUDA backend (`thrust::cuda_cub::`, `thrust/system/cuda/detail/`). The "
        "translated names do not compile.",
        "Use the public API (`hipcub::WarpReduce`, `hipcub::WarpScan`), or keep a copy of what the internal did in "
        "the project.",
        before="typedef cub::WarpReduceShfl<T, 32> WarpReduce;",
        after="typedef hipcub::WarpReduce<T, 32> WarpReduce;",
        pattern=re.compile(r"\bcub::(?:Warp(?:Reduce|Scan)(?:Shfl|Smem)|Block(?:Reduce|Scan)(?:Raking|Warp)\w*)\b"
                           r"|\bthrust::cuda_cub::|thrust/system/cuda/detail/"),
    ),
    Rule(
        "typedef-anonymous-struct", "warning", "an unnamed struct with a base class named by a typedef",
        "`typedef struct : Base { ... } T;` gives a non-C-compatible unnamed class a name for linkage through a "
        "typedef, which C++20 made ill-formed (P1766). nvcc's host compiler (g++) says nothing; clang, which compiles "
        "every HIP source, warns by default (-Wnon-c-typedef-for-linkage), an error under a project's -Werror.",
        "Give the struct a tag name: `typedef struct T_struct : Base { ... } T;` (or `struct T : Base { ... };`).",
        before="typedef struct : task_base { int offset; } smem_task;",
        after="typedef struct smem_task_struct : task_base { int offset; } smem_task;",
        pattern=re.compile(r"\btypedef\s+(?:struct|class)\s*:\s*(?!:)"),
    ),
    Rule(
        "unroll-unknown-trip", "note", "`#pragma unroll` on a loop hip-clang cannot count",
        "LLVM unrolls a loop (fully, or by the pragma's count with a remainder) only when it can compute the trip count. "
        "A geometric step (`offset >>= 1`) from a run-time start, an early `break` / `return` out of a loop with a "
        "run-time bound, or an unrolled loop with a run-time bound inside one (unrolled with a remainder loop, it "
        "leaves the outer loop no longer innermost) defeats that, and hip-clang warns 'loop not unrolled: the "
        "optimizer was unable to perform the requested transformation' (-Wpass-failed) for every instantiation, an "
        "error under -Werror; nvcc drops the "
        "request silently. The code is unchanged, only the compile log fills (GPUMD's force sums, llama.cpp's softmax).",
        "Drop the pragma where the bound is a run-time value, give the loop a compile-time bound (a template parameter), "
        "or silence the warning around the kernel under `__clang__` (`#pragma clang diagnostic ignored \"-Wpass-failed\"`).",
        before="__global__ void sum(float* s) {\n#pragma unroll\n  for (int o = blockDim.x >> 1; o > 0; o >>= 1) {\n"
               "    if (threadIdx.x < o) s[threadIdx.x] += s[threadIdx.x + o];\n    __syncthreads();\n  }\n}",
        after="__global__ void sum(float* s) {\n  for (int o = blockDim.x >> 1; o > 0; o >>= 1) {\n"
              "    if (threadIdx.x < o) s[threadIdx.x] += s[threadIdx.x + o];\n    __syncthreads();\n  }\n}",
        check=check_unroll_unknown_trip,
    ),
    Rule(
        "capture-info-v2", "error", "`cudaStreamGetCaptureInfo` with CUDA 12's six arguments",
        "hipify maps `cudaStreamGetCaptureInfo` to `hipStreamGetCaptureInfo`, which takes three arguments (stream, "
        "status, id); CUDA 12's six-argument form is `hipStreamGetCaptureInfo_v2` in HIP: the call does not compile.",
        "Call `hipStreamGetCaptureInfo_v2` under `USE_ROCM` (or `cudaStreamGetCaptureInfo_v2` on both).",
        before="cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, nullptr, nullptr);",
        after="cudaStreamGetCaptureInfo_v2(stream, &status, nullptr, &graph, nullptr, nullptr);",
        check=check_capture_info_arity,
    ),
    Rule(
        "runtime-overload", "error", "CUDA runtime call through an overload or default argument HIP lacks",
        "CUDA's runtime headers give some calls a C++ overload or a default argument: `cudaEventCreate(&event, "
        "flags)`, `cudaStreamWaitEvent(stream, event)` with flags 0. hipify renames them to `hipEventCreate`, which "
        "takes the event alone, and `hipStreamWaitEvent`, whose flags had no default before ROCm 6.1 "
        "(hip_runtime_api.h), so the call does not compile (`tiletune hipify`'s torch engine rewrites both).",
        "Call `hipEventCreateWithFlags(&event, flags)`; pass `hipStreamWaitEvent` its flags (0).",
        before="cudaEventCreate(&done, cudaEventDisableTiming);\ncudaStreamWaitEvent(stream, done);",
        after="cudaEventCreateWithFlags(&done, cudaEventDisableTiming);\ncudaStreamWaitEvent(stream, done, 0);",
        check=check_runtime_overloads,
    ),
]

RULES_BY_ID: dict[str, Rule] = {rule.id: rule for rule in RULES}
