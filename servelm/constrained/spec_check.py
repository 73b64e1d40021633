"""Checks of a grammar spec before anything compiles it: a size budget and satisfiability.

Both run without a tokenizer, in the server (a 400 before the request reaches the engine) and
again in the engine's compile path (the offline API skips the server), and both are linear in
the spec's size.

- Size: the spec's bytes (``--max-grammar-spec-bytes``) and its nesting depth
  (``MAX_SPEC_DEPTH``). Grammar compilers are superlinear in both: xgrammar took 35 s for an array
  schema nested 900 deep and over 300 s for 10k optional properties, so the budget keeps one
  request's compile within seconds; ``--grammar-compile-timeout`` is the backstop.
- Satisfiability of a JSON schema: a schema that can match no finite JSON value (``false``, an
  empty enum, ``"not": {}``, minimum > maximum, a property that must contain the object itself)
  is refused naming where. xgrammar allocates without bound on a required self-recursion, and a
  grammar with no finite completion would otherwise decode forced text until the context ends.

Invariant: the satisfiability check only refuses what is certainly empty. Every rule is an
over-approximation (a pattern or a oneOf's exclusivity is ignored), so a schema it passes may
still be empty, but a schema it refuses is.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from servelm.constrained.grammar import GrammarError

MAX_SPEC_DEPTH = 64
"""Deepest nesting of a spec (JSON arrays/objects of a schema or choice list, brackets of a regex
or EBNF grammar). Realistic schemas stay under 10 (OpenAI's limit); compile cost grows as the
cube of depth (xgrammar: 0.06 s at 64 levels, 35 s at 900)."""

_OBJECT_WORDS = ("properties", "required", "additionalProperties", "patternProperties",
                 "minProperties", "maxProperties", "propertyNames")
_ARRAY_WORDS = ("items", "prefixItems", "minItems", "maxItems", "contains", "uniqueItems")
_STRING_WORDS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_WORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_ALL_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


# -- size ---------------------------------------------------------------------------------------

def check_size(kind: str, spec: str, max_spec_bytes: int | None) -> None:
    """GrammarError when ``spec`` is over ``max_spec_bytes`` bytes (None: no byte limit) or
    nested deeper than MAX_SPEC_DEPTH levels."""
    num_bytes = len(spec.encode("utf-8", errors="surrogatepass"))
    if max_spec_bytes is not None and num_bytes > max_spec_bytes:
        raise GrammarError(f"the {_WHAT.get(kind, kind)} is {num_bytes} bytes; this server compiles "
                        f"grammars of at most {max_spec_bytes} bytes (--max-grammar-spec-bytes)")
    depth = _nesting_depth(kind, spec)
    if depth > MAX_SPEC_DEPTH:
        raise GrammarError(f"the {_WHAT.get(kind, kind)} is nested {depth} levels deep; at most "
                        f"{MAX_SPEC_DEPTH} are supported")


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
         "ebnf": "EBNF grammar", "choice": "choice list"}


def _nesting_depth(kind: str, spec: str) -> int:
    """Bracket nesting of the text, skipping quoted strings (JSON, EBNF) and escapes; it
    never parses, so a deep spec costs no recursion."""
    opening, closing = ("[{", "]}") if kind in ("json", "choice") else ("([{", ")]}")
    quotes = '"' if kind != "regex" else ""
    depth = deepest = 0
    quote: str | None = None
    escaped = False
    for char in spec:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif quote is not None:
            if char == quote:
                quote = None
        elif char in quotes:
            quote = char
        elif char in opening:
            depth += 1
            deepest = max(deepest, depth)
        elif char in closing:
            depth -= 1
    return deepest


# -- JSON schema satisfiability -------------------------------------------------------------------

@dataclass(slots=True)
class _Node:
    """One gate of the schema's satisfiability circuit: a schema (or one of its parts) can
    produce a finite value when all (``is_all``) or any of its inputs can."""

    path: str
    is_all: bool
    inputs: list[int] = field(default_factory=list)
    reason: str | None = None
    """Why a leaf can never be satisfied (a node with no inputs and a reason is false)."""
    num_missing: int = 0
    is_productive: bool = False


class _Circuit:
    """Build the gates of a schema, then propagate "can produce a finite value" (linear)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.nodes: list[_Node] = []
        self._by_ref: dict[str, int] = {}
        self._built: dict[int, int] = {}
        """Gate of each schema object by id: a subschema named by several $refs (or by a $ref and
        its own place) is built once, so the circuit is linear in the spec."""
        self._pending_refs: list[tuple[int, str]] = []

    def gate(self, path: str, is_all: bool, reason: str | None = None) -> int:
        self.nodes.append(_Node(path, is_all, reason=reason))
        return len(self.nodes) - 1

    def constant(self, path: str, value: bool, reason: str = "") -> int:
        # AND of nothing is true; OR of nothing is false.
        return self.gate(path, is_all=value, reason=None if value else reason)

    def build(self) -> int:
        root = self.schema(self.root, "#")
        while self._pending_refs:  # $ref targets are built once, after the schema that names them
            node, ref = self._pending_refs.pop()
            target = self._by_ref.get(ref)
            if target is None:
                resolved = _resolve(self.root, ref)
                target = (self.constant(ref, True) if resolved is _UNRESOLVED
                          else self.schema(resolved, ref))
                self._by_ref[ref] = target
            self.nodes[node].inputs.append(target)
        return root

    def schema(self, schema: Any, path: str) -> int:
        if schema is True or schema == {}:
            return self.constant(path, True)
        if schema is False:
            return self.constant(path, False, "is false (matches nothing)")
        if not isinstance(schema, dict):
            return self.constant(path, True)  # not a schema: the backend names the problem
        if id(schema) in self._built:
            return self._built[id(schema)]
        node = self.gate(path, is_all=True)
        self._built[id(schema)] = node
        parts: list[int] = []
        if isinstance(schema.get("$ref"), str):
            ref_node = self.gate(f"{path}/$ref", is_all=True)
            self._pending_refs.append((ref_node, schema["$ref"]))
            parts.append(ref_node)
        for word in ("allOf",):
            for index, sub in enumerate(_list(schema.get(word))):
                parts.append(self.schema(sub, f"{path}/{word}/{index}"))
        for word in ("anyOf", "oneOf"):
            if word in schema and isinstance(schema[word], list):
                branches = self.gate(f"{path}/{word}", is_all=False,
                                     reason=f"has an empty {word}" if not schema[word] else None)
                self.nodes[branches].inputs = [self.schema(sub, f"{path}/{word}/{index}")
                                               for index, sub in enumerate(schema[word])]
                parts.append(branches)
        if "enum" in schema and schema["enum"] == []:
            parts.append(self.constant(path, False, "has an empty enum"))
        if "not" in schema and (schema["not"] is True or schema["not"] == {}):
            parts.append(self.constant(path, False, "has not: {} (matches nothing)"))
        if "const" not in schema and "enum" not in schema:
            parts.append(self._types(schema, path))
        self.nodes[node].inputs = parts
        return node

    def _types(self, schema: dict[str, Any], path: str) -> int:
        types = schema.get("type")
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types:
            types = _inferred_types(schema)
        node = self.gate(f"{path}/type", is_all=False, reason=None)
        for name in types:
            if name == "object":
                self.nodes[node].inputs.append(self._object(schema, path))
            elif name == "array":
                self.nodes[node].inputs.append(self._array(schema, path))
            else:
                self.nodes[node].inputs.append(self._scalar(schema, path, name))
        return node

    def _object(self, schema: dict[str, Any], path: str) -> int:
        low, high = schema.get("minProperties", 0), schema.get("maxProperties")
        if _is_int(low) and _is_int(high) and low > high:
            return self.constant(path, False, f"has minProperties {low} > maxProperties {high}")
        node = self.gate(f"{path}/properties", is_all=True)
        properties: dict[str, Any] = (schema["properties"] if isinstance(schema.get("properties"), dict)
                                      else {})
        additional = schema.get("additionalProperties", True)
        # Every property gets its gate (an optional one only for dead_loop); required ones feed this.
        gates = {name: self.schema(sub, f"{path}/properties/{name}") for name, sub in properties.items()}
        additional_gate = self.schema(additional, f"{path}/additionalProperties")
        for name in _list(schema.get("required")):
            if not isinstance(name, str):
                continue
            if name in gates:
                self.nodes[node].inputs.append(gates[name])
            elif "patternProperties" not in schema:
                self.nodes[node].inputs.append(additional_gate)
        return node

    def _array(self, schema: dict[str, Any], path: str) -> int:
        low: int = schema["minItems"] if _is_int(schema.get("minItems")) else 0
        high = schema.get("maxItems")
        if _is_int(high) and low > high:
            return self.constant(path, False, f"has minItems {low} > maxItems {high}")
        node = self.gate(f"{path}/items", is_all=True)
        prefix = _list(schema.get("prefixItems"))
        items = schema.get("items", True)
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        prefix_gates = [self.schema(sub, f"{path}/prefixItems/{index}") for index, sub in enumerate(prefix)]
        items_gate = self.schema(items, f"{path}/items")  # built even when optional (dead_loop)
        self.nodes[node].inputs.extend(prefix_gates[:low])
        if low > len(prefix):
            self.nodes[node].inputs.append(items_gate)
        return node

    def _scalar(self, schema: dict[str, Any], path: str, name: str) -> int:
        if name == "string":
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            if _is_int(low) and _is_int(high) and low > high:
                return self.constant(path, False, f"has minLength {low} > maxLength {high}")
        if name in ("number", "integer"):
            low_value, high_value = schema.get("minimum"), schema.get("maximum")
            if _is_number(low_value) and _is_number(high_value) and low_value > high_value:
                return self.constant(path, False, f"has minimum {low_value} > maximum {high_value}")
        return self.constant(path, True)

    def propagate(self) -> None:
        """Least fixpoint: a gate is productive once all/any of its inputs are (Horn clauses)."""
        users: list[list[int]] = [[] for _ in self.nodes]
        ready: deque[int] = deque()
        for index, node in enumerate(self.nodes):
            for source in node.inputs:
                users[source].append(index)
            node.num_missing = len(node.inputs) if node.is_all else 1
            if node.is_all and not node.inputs:
                node.is_productive = True
                ready.append(index)
        while ready:
            source = ready.popleft()
            for index in users[source]:
                node = self.nodes[index]
                if node.is_productive:
                    continue
                node.num_missing -= 1
                if node.num_missing == 0:
                    node.is_productive = True
                    ready.append(index)

    def explain(self, root: int) -> str:
        """Why ``root`` is unproductive: a contradictory leaf, or a $ref cycle with no way out."""
        on_path: set[int] = set()
        seen: set[int] = set()
        stack: list[tuple[int, int]] = [(root, 0)]
        while stack:  # depth-first over unproductive inputs, iteratively (specs may be deep)
            index, position = stack.pop()
            node = self.nodes[index]
            if position == 0:
                if node.reason is not None:
                    return f"{node.path} {node.reason}"
                on_path.add(index)
                seen.add(index)
            blocked = [i for i in node.inputs if not self.nodes[i].is_productive]
            if position < len(blocked):
                stack.append((index, position + 1))
                child = blocked[position]
                if child in on_path:
                    return (f"{node.path} leads back to {self.nodes[child].path} with no way out "
                            "(a value would have to contain itself: it could never end)")
                if child not in seen:
                    stack.append((child, 0))
            else:
                on_path.discard(index)
        return "it has no finite value"


    def dead_loop(self) -> str | None:
        """A cycle among unproductive gates (a recursion no value can leave), described; None
        when there is none. Iterative three-colour DFS: linear, and no recursion limit."""
        state = [0] * len(self.nodes)  # 0 unvisited, 1 on the DFS path, 2 done
        for start, node in enumerate(self.nodes):
            if node.is_productive or state[start]:
                continue
            stack: list[tuple[int, int]] = [(start, 0)]
            state[start] = 1
            while stack:
                index, position = stack.pop()
                blocked = [i for i in self.nodes[index].inputs if not self.nodes[i].is_productive]
                if position == len(blocked):
                    state[index] = 2
                    continue
                stack.append((index, position + 1))
                child = blocked[position]
                if state[child] == 1:
                    return (f"{self.nodes[index].path} leads back to {self.nodes[child].path} "
                            "(a value would have to contain itself: it could never end)")
                if state[child] == 0:
                    state[child] = 1
                    stack.append((child, 0))
        return None


_UNRESOLVED = object()


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local JSON pointer ``#/...`` names; _UNRESOLVED for anything else."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _UNRESOLVED
    target = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return _UNRESOLVED
    return target


def _inferred_types(schema: dict[str, Any]) -> list[str]:
    """The instance types a schema without "type" is read as (xgrammar's reading: keywords of
    one kind imply that type)."""
    types = [name for name, words in (("object", _OBJECT_WORDS), ("array", _ARRAY_WORDS),
                                      ("string", _STRING_WORDS), ("number", _NUMBER_WORDS))
             if any(word in schema for word in words)]
    return types or list(_ALL_TYPES)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_json_schema(schema: Any) -> None:
    """GrammarError naming the place when the schema can certainly match no finite JSON value,
    or has a recursion with no way out anywhere (an optional property that must contain itself:
    xgrammar's compiler allocates without bound on that too)."""
    circuit = _Circuit(schema)
    root = circuit.build()
    circuit.propagate()
    if not circuit.nodes[root].is_productive:
        raise GrammarError(f"the JSON schema matches no finite JSON value: {circuit.explain(root)}")
    loop = circuit.dead_loop()
    if loop is not None:
        raise GrammarError(f"the JSON schema has a recursion with no way out: {loop}")


def check_spec(kind: str, spec: str, max_spec_bytes: int | None) -> None:
    """The size budget for every kind, then satisfiability for a JSON schema."""
    check_size(kind, spec, max_spec_bytes)
    if kind == "json":
        try:
            schema = json.loads(spec)
        except (json.JSONDecodeError, RecursionError):
            return  # the backend names the syntax error
        check_json_schema(schema)
