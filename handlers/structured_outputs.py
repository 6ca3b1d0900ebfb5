"""What shape a request asks its answer to take, as a grammar the engine enforces (runtime/engine/grammar.py).

OpenAI's `response_format` (`json_object`, `json_schema`), and vLLM's own: `structured_outputs` with one of
`json` (a schema), `json_object`, `regex`, `choice` (a list of strings) or `grammar` (Lark or GBNF), and the
older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`. One of them per request. What is
wrong inside a schema, regex or grammar is found when the engine compiles it, still before the first byte.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.engine.sampling_params import GrammarSpec
from runtime.server.errors import bad_request

#: vLLM's older parameters -> the `structured_outputs` key each stands for
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def request_grammar(body: dict[str, Any]) -> GrammarSpec | None:
    specs = [spec for spec in (_response_format(body.get("response_format")),) if spec is not None]
    for param, key in GUIDED.items():
        if body.get(param) is not None:
            specs.append(_structured(key, body[param], param))
    options = body.get("structured_outputs")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'structured_outputs' must be an object", "structured_outputs")
        specs += [_structured(key, options[key], "structured_outputs") for key in STRUCTURED_KEYS
                  if options.get(key) not in (None, False)]
    if len(specs) > 1:
        raise bad_request("ask for one answer format at a time (response_format, structured_outputs or "
                          "guided_*)", specs[1].param)
    return specs[0] if specs else None


def _response_format(fmt: Any) -> GrammarSpec | None:
    """OpenAI's: its type is checked with the other shared parameters (handlers/openai_protocol.py)."""
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return GrammarSpec("json_schema", '{"type": "object"}')
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad_request("'response_format.json_schema' must be an object with a 'schema' object",
                          "response_format")
    if "name" in spec and not isinstance(spec["name"], str):
        raise bad_request("'response_format.json_schema.name' must be a string", "response_format")
    return GrammarSpec("json_schema", json.dumps(spec.get("schema", {"type": "object"})))


def _structured(key: str, value: Any, param: str) -> GrammarSpec:
    if key == "json_object":
        return GrammarSpec("json_schema", '{"type": "object"}', param)
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"'{param}': the JSON schema does not parse", param) from None
        if not isinstance(value, dict):
            raise bad_request(f"'{param}': a JSON schema is an object", param)
        return GrammarSpec("json_schema", json.dumps(value), param)
    if key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"'{param}': the choices are a non-empty list of non-empty strings", param)
        return GrammarSpec("lark", "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value), param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}': the {key} is a non-empty string", param)
    return GrammarSpec(key, value, param)
