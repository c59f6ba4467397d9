"""The tiny model's tool-calling variant: its chat template, marker tokens and the extra
tokenizer corpus (``build_tiny_model(..., tools=True)``, ``default_model_path(tools=True)``).

The template is Hermes / Qwen-2.5 style: tools listed in the system turn, calls as
``<tool_call>{json}</tool_call>``, results in ``<tool_response>`` blocks of a user turn,
reasoning as ``<think>...</think>``. ``<tool_call>`` / ``</tool_call>`` are special
tokens (``skip_special_tokens=True`` drops them, as for Llama 3.1 or Mistral markers);
``<think>`` / ``</think>`` are plain added tokens. vLLM's ``hermes`` tool parser and
``qwen3`` reasoning parser work on it. The default tiny model's files are unchanged.
"""

from __future__ import annotations

import random

__all__ = ["SPECIAL_TOOL_TOKENS", "TOOLS_CHAT_TEMPLATE", "TOOL_TOKENS", "tool_corpus"]

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")  # ids 3-6 (tools=True)
SPECIAL_TOOL_TOKENS = frozenset(TOOL_TOKENS[:2])  # the call markers are special tokens

# The tools variant's template: a Hermes / Qwen-2.5-style ChatML template. Without tools
# and tool messages it renders exactly as CHAT_TEMPLATE. Calls follow the content with no
# separator (the parser's content is then exactly the content rendered), one per block.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\nYou may call functions. Their signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nFor each call, write <tool_call>{"name": <name>, "arguments": '
    "<json object>}</tool_call>.<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.get('reasoning_content') is string %}"
    "{{- '<think>' + message['reasoning_content'] + '</think>' }}{%- endif %}"
    "{{- message['content'] or '' }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call['function'] %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tool_corpus() -> list[str]:
    """Extra text for the tools variant: calls, results and the tools preamble."""
    rng = random.Random(20251125)
    corpus = []
    for i in range(300):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = ("add", "subtract", "multiply")[i % 3]
        corpus.append(
            f'user\nWhat is {a} + {b}?\nassistant\n<tool_call>\n{{"name": "{op}", '
            f'"arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>\nuser\n<tool_response>\n'
            f"{a + b}\n</tool_response>\nassistant\nThe answer is {a + b}.\n"
            f'# Tools {{"type": "function", "function": {{"name": "{op}", "description": '
            '"Add two integers.", "parameters": {"type": "object", "properties": {"a": '
            '{"type": "integer"}}, "required": ["a", "b"]}}}\n'
        )
    return corpus
