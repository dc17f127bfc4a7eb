"""What a chat request's ``tools`` and ``tool_choice`` mean, resolved once per request as vLLM 0.32
resolves them: the definitions the chat template gets, whether and how the output is read back into
calls, and for ``required`` or a named function the JSON schema that constrains the output (vLLM's
``get_json_schema_from_tools``), set on the request's ``SamplingParams.structured_outputs``."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.errors import InvalidRequestError, SamplingParamsError
from kvpilot.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvpilot.engine.server import protocol
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.tool_parsers import (
    PARSERS,
    NamedStream,
    ParsedOutput,
    RequiredStream,
    ToolCallStream,
    parse_named,
    parse_required,
)
from kvpilot.engine.structured_output import check_constraint

MAX_TOOLS = 128  # OpenAI's bound on the tools of one request


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses tools, resolved once from ``tools``, ``tool_choice`` and the server's flags
    (:func:`resolve_tools`).

    ``mode``: "none" (plain text; the tools are still shown to the template), "auto" (the output is
    read by the ``--tool-call-parser``), "required" or "named" (the output is constrained to ``schema``
    and always read as calls). ``tools``: the definitions for the template (None: no tools)."""

    mode: str = "none"
    tools: list[dict[str, Any]] | None = None
    parser: str | None = None
    function: str | None = None  # the named function
    schema: dict[str, Any] | None = None

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the output constrained to ``schema`` (required / named), else unchanged."""
        if self.schema is None:
            return params
        if params.structured_outputs is not None:
            raise bad_request(
                "a named or required tool_choice constrains the output itself: it cannot be combined "
                "with response_format or structured_outputs",
                param="tool_choice",
            )
        try:
            constraint = StructuredOutputsParams(json=self.schema)
            check_constraint(constraint)  # a schema the grammar library refuses is the client's 400
            return dataclasses.replace(params, structured_outputs=constraint)
        except (SamplingParamsError, InvalidRequestError) as exc:
            message = str(exc).replace("structured_outputs.json", "the schema", 1)
            raise bad_request(
                f"the tools' parameters cannot constrain the output: {message}", param="tools"
            ) from None

    def parse(self, text: str) -> ParsedOutput | None:
        """The calls in a whole output (None: this request does not read calls)."""
        if self.mode == "auto":
            return PARSERS[self.parser].parse(text)  # type: ignore[index]
        if self.mode == "required":
            return parse_required(text)
        if self.mode == "named":
            return parse_named(self.function, text)  # type: ignore[arg-type]
        return None

    def stream(self) -> ToolCallStream | None:
        """A reader for one streamed choice (None: this request does not read calls)."""
        if self.mode == "auto":
            return PARSERS[self.parser].stream()  # type: ignore[index]
        if self.mode == "required":
            return RequiredStream()
        if self.mode == "named":
            return NamedStream(self.function)  # type: ignore[arg-type]
        return None

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """A choice's finish_reason once calls were found in it, as vLLM streams it (and OpenAI
        reports it): "tool_calls" for auto and required when the output ended normally; a named call
        keeps its own ("stop"), and so does an output cut short ("length"). vLLM's non-streamed
        answer says "tool_calls" for an auto call cut short too; here both agree."""
        if self.mode in ("auto", "required") and finish_reason == "stop":
            return "tool_calls"
        return finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole output and its finish_reason."""
        parsed = self.parse(text)
        if parsed is None or not parsed.tool_calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {
            "role": "assistant",
            "content": parsed.content if parsed.content and parsed.content.strip() else None,
            "tool_calls": [call.as_dict() for call in parsed.tool_calls],
        }
        return message, self.finish_reason(finish_reason)


def resolve_tools(
    req: protocol.ChatCompletionRequest, enable_auto_tool_choice: bool, tool_call_parser: str | None
) -> ToolPlan:
    """The request's :class:`ToolPlan`; a 400 naming ``tools`` or ``tool_choice`` for a malformed
    definition or choice, as vLLM 0.32 checks them: an empty ``tools``, ``tool_choice`` (other than
    "none") without tools, a named function that is not among the tools, and any choice but "none" on
    a server started without ``--enable-auto-tool-choice`` (vLLM loads its tool parser only with that
    flag, and refuses "auto", "required" and named choices without one)."""
    tools = None if req.tools is None else _tool_definitions(req.tools)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"  # vLLM's (and OpenAI's) default
    if choice == "none":
        # As vLLM (without --exclude-tools-when-tool-choice-none): the template still sees the tools,
        # and the output is plain content, never read for calls.
        return ToolPlan("none", tools)
    if not tools:
        raise bad_request("when using tool_choice, tools must be set", param="tool_choice")
    if isinstance(choice, str) and choice not in ("auto", "required"):
        raise bad_request(
            f"invalid tool_choice {choice!r}: use 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    name = None if isinstance(choice, str) else _named_choice(choice)
    if not enable_auto_tool_choice or tool_call_parser is None:
        what = '"auto" tool choice' if choice == "auto" else f"tool_choice={choice!r}"
        if name is not None:
            what = f'tool_choice=function "{name}"'
        raise bad_request(
            f"{what} requires --enable-auto-tool-choice and --tool-call-parser to be set", param="tool_choice"
        )
    if choice == "auto":
        return ToolPlan("auto", tools, parser=tool_call_parser)
    if choice == "required":
        return ToolPlan("required", tools, parser=tool_call_parser, schema=_required_schema(tools))
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
    if name not in by_name:
        raise bad_request(
            f"tool_choice names function {name!r}, which is not among the tools ({', '.join(by_name)})",
            param="tool_choice",
        )
    # The output is the function's arguments. A function without parameters takes an empty object
    # (vLLM leaves such an output unconstrained; an object is what its arguments must be).
    schema = copy.deepcopy(by_name[name].get("parameters") or {"type": "object", "properties": {}})
    return ToolPlan("named", tools, parser=tool_call_parser, function=name, schema=schema)


def _tool_definitions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools, checked: each ``{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}`` with a distinct name."""
    if not tools:
        raise bad_request(
            "tools must not be an empty array: give at least one tool or leave the field out", param="tools"
        )
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed", param="tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise bad_request(
                f"{where}.type must be 'function', got {tool.get('type')!r}", param=f"{where}.type"
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(
                f"{where}.function.name must be a non-empty string", param=f"{where}.function.name"
            )
        if name in names:
            raise bad_request(f"two tools are named {name!r}", param=f"{where}.function.name")
        names.add(name)
        definition: dict[str, Any] = {"name": name}
        for key, kind, what in (
            ("description", str, "a string"),
            ("parameters", dict, "a JSON schema object"),
            ("strict", bool, "a boolean"),
        ):
            value = fn.get(key)
            if value is None:
                continue
            if not isinstance(value, kind):
                raise bad_request(f"{where}.function.{key} must be {what}", param=f"{where}.function.{key}")
            definition[key] = value
        out.append({"type": "function", "function": definition})
    return out


def _named_choice(choice: dict[str, Any]) -> str:
    usage = 'use {"type": "function", "function": {"name": "my_function"}}'
    if choice.get("type", "function") != "function":
        raise bad_request(f"tool_choice.type must be 'function'; {usage}", param="tool_choice.type")
    fn = choice.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"tool_choice.function must be an object; {usage}", param="tool_choice.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(
            f"tool_choice.function.name must be a non-empty string; {usage}",
            param="tool_choice.function.name",
        )
    return name


def _required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: an array of at least one
    ``{"name": <one tool's name>, "parameters": <its parameters>}``, the tools' ``$defs`` gathered at
    the top so that their references resolve."""
    variants, defs = [], {}
    for tool in tools:
        fn = tool["function"]
        params = copy.deepcopy(fn.get("parameters") or {"type": "object", "properties": {}})
        for def_name, def_schema in params.pop("$defs", {}).items():
            if def_name in defs and defs[def_name] != def_schema:
                raise bad_request(f"the tools define $defs {def_name!r} twice, differently", param="tools")
            defs[def_name] = def_schema
        variants.append(
            {
                "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema
