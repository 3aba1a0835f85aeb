# -*- coding: utf-8 -*-
"""A stand-in for a DeepSeek-V4 checkpoint's ``encoding/encoding_dsv4.py`` (invented for
tests/test_chat_v4.py): the constant names are the release encoder's, the wording is ours.

The chat layer must read the string constants below with ``ast`` and never run this file:
importing it fails (a missing module and a top-level ``raise``).
"""

import this_v4_module_does_not_exist_anywhere  # noqa: F401  (importing the file must fail)

bos_token: str = "<｜begin▁of▁sentence｜>"
dsml_token: str = "｜DSML｜"

response_format_template: str = "## Fixture Response Format\n\nJSON only, shaped like:\n{schema}"

REASONING_EFFORT_MAX = (
    "Fixture max effort: think as long as it takes.\n"
    "Check everything twice.\n\n"
)

TOOLS_TEMPLATE = """## Fixture Tools

Call tools with a "<{dsml_token}tool_calls>" block:

<{dsml_token}tool_calls>
<{dsml_token}invoke name="$TOOL_NAME">
<{dsml_token}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml_token}parameter>
</{dsml_token}invoke>
</{dsml_token}tool_calls>

Reason inside {thinking_start_token}...{thinking_end_token} first when thinking; else answer after {thinking_end_token}.

### Fixture Schemas

{tool_schemas}

Use the exact names.
"""

raise RuntimeError("this fixture must never be executed")
