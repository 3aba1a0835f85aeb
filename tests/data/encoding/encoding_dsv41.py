# -*- coding: utf-8 -*-
"""A stand-in for a checkpoint's ``encoding/`` module (invented for tests/test_chat.py).

The chat layer must read the string constants below with ``ast`` and never run this file:
importing it fails (a missing module, a call that raises, and a top-level ``raise``).
"""

import json
import os

import this_module_does_not_exist_anywhere  # noqa: F401  (importing the file must fail)
from textwrap import dedent

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
SYSTEM_TOKEN = "<｜System｜>"
DSML_TOKEN: str = "｜DSML｜"
TOOL_CALLS_BLOCK_NAME = " calls"
TOOL_CALL_TAG_NAME = " invoke"
TOOL_PARAMETER_TAG_NAME = " parameter"

_SCHEMA_HEADING = "### Tool Catalogue"

TOOLS_TEMPLATE = (
    "## Tools\n\n"
    "Fixture wording: call a tool with a \"<{dsml_token}{tc_block_name}>\" block:\n\n"
    "<{dsml_token}{tc_block_name}>\n"
    "<{dsml_token}{tool_call_tag_name} name=\"$TOOL_NAME\">\n"
    "<{dsml_token}{tool_parameter_tag_name} name=\"$PARAMETER_NAME\" string=\"true|false\">"
    "$PARAMETER_VALUE</{dsml_token}{tool_parameter_tag_name}>\n"
    "...\n"
    "</{dsml_token}{tool_call_tag_name}>\n"
    "<{dsml_token}{tool_call_tag_name} name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</{dsml_token}{tool_call_tag_name}>\n"
    "</{dsml_token}{tc_block_name}>\n\n"
    "Strings raw with string=\"true\"; anything else as JSON with string=\"false\".\n\n"
    "Thinking ({thinking_start_token}): reason fully inside "
    "{thinking_start_token}...{thinking_end_token} first; otherwise answer right after "
    "{thinking_end_token}.\n\n"
) + _SCHEMA_HEADING + "\n\n{tool_schemas}\n\n" + dedent(
    """\
    Use only the names and schemas listed.
    """
)

REASONING_EFFORT_TEMPLATE = (
    "Reasoning Effort: {budget} "
    "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
REASONING_EFFORT_MAPPINGS = {
    "low": 40,
    "high": 80,
    "max": 100,
}
DEFAULT_REASONING_EFFORT = "high"

RESPONSE_FORMAT_TEMPLATE = f"## Response Format (fixture)\n\n{{schema}}"

TOOL_OUTPUT_TEMPLATE = "<tool_result>{content}</tool_result>"

# Rebound to something computed: the reader must drop it rather than keep the literal.
SCRATCH = "literal first"
SCRATCH = os.environ.get("NOPE", "computed")

_LOADED_AT_IMPORT = json.loads(open("/definitely/not/a/file.json").read())


def encode_messages(messages, thinking_mode="chat"):
    raise RuntimeError("the fixture's functions must never be called")


class Encoder:
    def __init__(self):
        raise RuntimeError("never instantiated")


def _boom():
    raise RuntimeError("the fixture must never be executed")


_boom()
raise SystemExit("the fixture must never be executed")
