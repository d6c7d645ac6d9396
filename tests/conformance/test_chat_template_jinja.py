#!/usr/bin/env python3
"""Checks the chat-template interpreter (gpu_client/runner/chat_template.h) against
transformers' own rendering: byte-identical output, or the same failure.

  test_chat_template_jinja.py [--cli build/tests/tmpl_cli] [--verbose] [--keep DIR]

The oracle is transformers.utils.chat_template_utils.render_jinja_template (what
apply_chat_template calls: its sandboxed jinja2 environment with trim_blocks,
lstrip_blocks, loopcontrols, raise_exception, strftime_now, namespace and its tojson).
The C side gets the variables that function hands to the template: the conversation
after transformers' normalization (keys whose value is None dropped, reasoning fields
aliased), tools, documents=None, add_generation_prompt and the special tokens and extras.

Templates are written here in the style of each family (not copies of the published
ones): Qwen3 (tools, <think> handling, enable_thinking, the reversed scan for the last
user query), Qwen3-Coder (a macro over |items, tojson|safe, loop.previtem / nextitem),
DeepSeek-V3 / R1 (namespace flags, fenced JSON tool calls), DeepSeek-V3.1 (thinking,
split('</think>', 1), tojson), Kimi-K2 (macros, range() backwards with break, slices,
dict.get, tojson(separators=...)), Mixtral (role alternation with raise_exception),
Mistral with tools (selectattr|list, items() with an if, id length checks), plus a
whitespace-control template and an expression zoo. Each is rendered over every
conversation of conversations() with add_generation_prompt both ways (and
enable_thinking true / false / absent where the family reads it); half the runs go
through the cJSON entry point (contexts without floats, where cJSON is exact).

Then 1100 random templates from fixed seeds, each rendered once against jinja2 in
transformers' environment: expressions (operators, filters, tests, methods, slices over
the conversation), statements (scoping of set in loops / set blocks / macros, for-else
with break and continue, namespaces, macro defaults) and whitespace control (every sign,
trim_blocks, lstrip_blocks, raw, comments, odd whitespace). The documented differences
(what Python prints as a memory address, integers beyond 64 bits) are counted apart.

Also checks: templates with constructs outside the subset are refused naming the
construct and its line; raise_exception's message comes back bare as MR_EPRECOND.
Last line: "test_chat_template_jinja: N passed, N failed".
"""
import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import warnings

# jinja2 compiles a random `1[0]` to Python source that Python warns about.
warnings.filterwarnings("ignore", category=SyntaxWarning)

try:
    from transformers.utils import chat_template_utils as ctu
except Exception as exc:  # noqa: BLE001
    print(f"skip test_chat_template_jinja: transformers not importable ({exc})")
    print("test_chat_template_jinja: 0 passed, 0 failed")
    sys.exit(0)

BOS, EOS = "<s>", "</s>"

# ---------------------------------------------------------------------------------------
# Templates in the style of each family.

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nThese functions can be called; their signatures are in <tools></tools>:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nCall one as:\n<tool_call>\n{\"name\": <name>, \"arguments\": <json>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages and messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
        {%- for part in message.content if part.type == 'text' %}
            {%- set content = content ~ part.text %}
        {%- endfor %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

QWEN3_CODER = r"""{% macro extra_keys(json_dict, handled_keys) %}
    {%- if json_dict is mapping %}
        {%- for json_key in json_dict if json_key not in handled_keys %}
            {%- if json_dict[json_key] is mapping or (json_dict[json_key] is sequence and json_dict[json_key] is not string) %}
                {{- '\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | tojson | safe) ~ '</' ~ json_key ~ '>' }}
            {%- else %}
                {{-'\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | string) ~ '</' ~ json_key ~ '>' }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{% endmacro %}

{%- if messages and messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined or tools is none %}
    {%- set tools = [] %}
{%- endif %}
{%- if system_message is defined %}
    {{- "<|im_start|>system\n" + system_message }}
{%- elif tools is iterable and tools | length > 0 %}
    {{- "<|im_start|>system\nYou are a coding assistant." }}
{%- endif %}
{%- if tools is iterable and tools | length > 0 %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {{- "\n<function>\n<name>" ~ tool.name ~ "</name>" }}
        {%- if tool.description is defined %}
            {{- '\n<description>' ~ (tool.description | trim) ~ '</description>' }}
        {%- endif %}
        {{- '\n<parameters>' }}
        {%- if tool.parameters is defined and tool.parameters is mapping and tool.parameters.properties is defined and tool.parameters.properties is mapping %}
            {%- for param_name, param_fields in tool.parameters.properties|items %}
                {{- '\n<parameter>\n<name>' ~ param_name ~ '</name>' }}
                {%- if param_fields.type is defined %}
                    {{- '\n<type>' ~ (param_fields.type | string) ~ '</type>' }}
                {%- endif %}
                {%- if param_fields.description is defined %}
                    {{- '\n<description>' ~ (param_fields.description | trim) ~ '</description>' }}
                {%- endif %}
                {{- extra_keys(param_fields, ['name', 'type', 'description']) }}
                {{- '\n</parameter>' }}
            {%- endfor %}
        {%- endif %}
        {% set handled_keys = ['type', 'properties'] %}
        {{- extra_keys(tool.parameters, handled_keys) }}
        {{- '\n</parameters>' }}
        {{- extra_keys(tool, ['type', 'name', 'description', 'parameters']) }}
        {{- '\n</function>' }}
    {%- endfor %}
    {{- "\n</tools>\n\nCall a tool as <tool_call><function=NAME><parameter=P>V</parameter></function></tool_call>." }}
{%- endif %}
{%- if system_message is defined or (tools is iterable and tools | length > 0) %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string and message.content | trim | length > 0 %}
            {{- '\n' + message.content | trim + '\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is defined and tool_call.arguments is mapping %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role in ["user", "system", "assistant"] %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content if message.content is string else message.content | map(attribute='text') | join('')) + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user\n' }}
        {%- endif %}
        {{- '<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>\n' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

DEEPSEEK_V3 = r"""{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is not defined or message['content'] is none %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %}"""

DEEPSEEK_V31 = r"""{% if not add_generation_prompt is defined -%}
  {%- set add_generation_prompt = false -%}
{%- endif -%}
{%- if not thinking is defined -%}
  {%- if enable_thinking is defined -%}
    {%- set thinking = enable_thinking -%}
  {%- else -%}
    {%- set thinking = false -%}
  {%- endif -%}
{%- endif -%}
{%- set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true, is_last_user=false) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- if ns.is_first_sp -%}
      {%- set ns.system_prompt = ns.system_prompt + message['content'] -%}
      {%- set ns.is_first_sp = false -%}
    {%- else -%}
      {%- set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] -%}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}
    {%- set ns.is_tool = false -%}
    {%- set ns.is_first = false -%}
    {%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content']}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}
    {%- if ns.is_last_user -%}{{'<｜Assistant｜></think>'}}
    {%- endif -%}
    {%- set ns.is_last_user = false -%}
    {%- set ns.is_first = false -%}
    {%- set ns.is_tool = false -%}
    {%- for tool in message['tool_calls'] -%}
      {%- if not ns.is_first -%}
        {%- if not message['content'] -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] | tojson + '<｜tool▁call▁end｜>'}}
        {%- else -%}{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] | tojson + '<｜tool▁call▁end｜>'}}
        {%- endif -%}
        {%- set ns.is_first = true -%}
      {%- else -%}{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] | tojson + '<｜tool▁call▁end｜>'}}
      {%- endif -%}
    {%- endfor -%}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or not message['tool_calls']) -%}
    {%- if ns.is_last_user -%}{{'<｜Assistant｜>'}}
      {%- if message['prefix'] is defined and message['prefix'] and thinking -%}{{'<think>'}}
      {%- else -%}{{'</think>'}}
      {%- endif -%}
    {%- endif -%}
    {%- set ns.is_last_user = false -%}
    {%- if ns.is_tool -%}{{message['content'] + '<｜end▁of▁sentence｜>'}}
      {%- set ns.is_tool = false -%}
    {%- else -%}
      {%- set content = message['content'] -%}
      {%- if '</think>' in content -%}
        {%- set content = content.split('</think>', 1)[1] -%}
      {%- endif -%}{{content + '<｜end▁of▁sentence｜>'}}
    {%- endif -%}
  {%- endif -%}
  {%- if message['role'] == 'tool' -%}
    {%- set ns.is_last_user = false -%}
    {%- set ns.is_tool = true -%}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool -%}{{'<｜Assistant｜>'}}
  {%- if not thinking -%}{{'</think>'}}
  {%- else -%}{{'<think>'}}
  {%- endif -%}
{%- endif %}"""

KIMI_K2 = r"""{%- macro show_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
      {{ c }}
    {%- elif c is not none -%}
      {% for part in c -%}
        {% if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}
          <|media_start|>image<|media_content|><|media_pad|><|media_end|>
        {% else -%}
          {{ part['text'] }}
        {%- endif -%}
      {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{% macro header(message) -%}
  {%- set who = message.get('name') or message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{who}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{who}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{who}}<|im_middle|>
  {%- endif -%}
{%- endmacro -%}

{%- macro calls(message) -%}
  <|tool_calls_section_begin|>
  {%- for tc in message['tool_calls'] -%}
    {%- set call_id = tc['id'] -%}
    <|tool_call_begin|>{{ call_id }}<|tool_call_argument_begin|>{% if tc['function']['arguments'] is string %}{{ tc['function']['arguments'] }}{% else %}{{ tc['function']['arguments'] | tojson(separators=(',', ':')) }}{% endif %}<|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}

{# The last assistant message without tool calls splits history from the tail. #}
{%- set ns = namespace(last_plain=-1) -%}
{%- for idx in range(messages|length-1, -1, -1) -%}
    {%- if messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') -%}
        {%- set ns.last_plain = idx -%}
        {%- break -%}
    {%- endif -%}
{%- endfor -%}
{%- set hist_msgs = messages[:ns.last_plain+1] -%}
{%- set tail_msgs = messages[ns.last_plain+1:] -%}

{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}

{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
  <|im_system|>system<|im_middle|>You are Kimi, a helpful assistant.<|im_end|>
{%- endif -%}

{%- for message in hist_msgs -%}
  {{header(message)}}
  {%- if message['role'] == 'assistant' -%}
    <think></think>{{show_content(message)}}
    {%- if message.get('tool_calls') -%}
      {{calls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{show_content(message)}}
  {%- elif message['content'] is not none -%}
    {{show_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}

{%- for message in tail_msgs -%}
  {{header(message)}}
  {%- if message['role'] == 'assistant' -%}
    {%- set rc = message.get('reasoning_content', '') -%}
    <think>{{rc}}</think>{{show_content(message)}}
    {%- if message.get('tool_calls') -%}
     {{calls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{show_content(message)}}
  {%- elif message['content'] is not none -%}
    {{show_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}

{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""

MIXTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

MISTRAL_TOOLS = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- The roles alternate, tool calls and results aside #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, roles must alternate user and assistant, tool calls and results aside.") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Whitespace control: every combination of -, +, trim_blocks and lstrip_blocks, raw,
# comments, set blocks, indented tags, tabs and blank lines.
WHITESPACE = "\n".join([
    "{# leading comment #}",
    "  {% if messages %}",
    "  first line",
    "    {%- for m in messages %}",
    "\t{{ m.role }}:  {{- m.content if m.content is string else '[parts]' -}}  ;",
    "  {%+ if loop.last %}LAST{% endif +%}",
    "  {% endfor %}",
    "  {% endif %}",
    "x  {%- if true %}  y {% endif -%}  z",
    "   {# c1 #}   after-comment",
    "   {#- c2 -#}   after-comment2",
    "{% raw %}  {{ not a tag }} {% endraw %}",
    "  {%- raw -%}  {%+ raw stays +%}  {%- endraw %}",
    "{% set block %}",
    "  captured {{ messages|length }}",
    "{% endset %}[{{ block }}]",
    "{%- set inline = 'v' %}",
    "    {{ inline }}",
    "\t\t{% if add_generation_prompt %}GEN{% else %}NOGEN{% endif %}",
    "end  ",
    "",
])

# An expression zoo over the conversation: filters, tests, methods, slices, arithmetic,
# repr of values, tojson options, loop attributes, generators, macros with defaults.
EXPRESSIONS = r"""{%- macro m(a, b=2, c='x') -%}[{{ a }}|{{ b }}|{{ c }}]{%- endmacro -%}
{{ m(1) }}{{ m(1, 3) }}{{ m(a=5, c='y') }}{{ m(1, c=none) }}
{% set roles = messages | map(attribute='role') | list -%}
roles={{ roles }} n={{ roles|length }} uniq={{ roles|unique|list }} sorted={{ roles|sort }} rsorted={{ roles|sort(reverse=true) }}
first={{ roles|first }} last={{ roles|last }} joined={{ roles|join(', ') }} count_user={{ messages|selectattr('role', 'equalto', 'user')|list|length }}
rej={{ messages|rejectattr('role', 'in', ['user', 'system'])|map(attribute='role')|list }}
{% for message in messages -%}
{%- set c = message.content if message.content is string else (message.content|map(attribute='text', default='?')|join('+')) -%}
{{ loop.index }}/{{ loop.length }} {{ loop.revindex0 }} {{ loop.cycle('odd', 'even') }} {{ loop.first }} {{ loop.last }} prev={{ loop.previtem.role if loop.previtem is defined else '-' }}
 repr={{ [c[:12], c|length, message.role|upper, message.role|capitalize, message.role|title] }}
 up={{ c|upper }} low={{ c|lower }} cap={{ c|capitalize }} tit={{ c|title }} mtit={{ c.title() }}
 strip=[{{ c|trim }}] [{{ c.strip(' .!') }}] [{{ c.lstrip() }}] [{{ c.rstrip('\n') }}]
 split={{ c.split() }} {{ c.split(' ', 1) }} {{ c.rsplit(None, 1) }} {{ c.split('\n') }} lines={{ c.splitlines() }}
 find={{ c.find('e') }} {{ c.rfind('e') }} count={{ c.count('e') }} {{ 'e' in c }} {{ c.startswith(('H', 'W')) }} {{ c.endswith('?') }}
 rev={{ c[::-1] }} {{ c[1:-1:2] }} {{ c[-3:] }} {{ c|reverse }} {{ c|replace('e', 'E', 1) }} {{ c.replace('', '|', 3) }}
 json={{ c|tojson }} {{ message|tojson(sort_keys=true) }} {{ message|tojson(indent=1) }} {{ c|tojson(ensure_ascii=true) }}
 items={% for k, v in message|items %}{{ k }}={{ v is string }};{% endfor %} keys={{ message.keys()|list }} get={{ message.get('name', 'anon') }}
 tests={{ message is mapping }} {{ c is string }} {{ c is sequence }} {{ message.tool_calls is defined }} {{ message.tool_calls is iterable }} {{ loop.index is odd }} {{ loop.index is divisibleby 3 }}
 ints={{ c|length * 3 // 2 }} {{ (c|length) % 7 }} {{ -(c|length) // 4 }} {{ c|length / 3 }} {{ 2 ** (loop.index) }} {{ (c|length)|float }} {{ '12'|int + 1 }} {{ 'x'|int(7) }} {{ '2.75'|float * 2 }}
 cmp={{ c < 'M' }} {{ roles < ['user'] }} {{ 1 < loop.index <= 3 }} {{ c|length == 0.0 }} {{ [c] == [c] }} {{ none is none }}
 default=[{{ message.missing|default('dflt') }}] [{{ c|default('empty', true) }}] [{{ message.missing }}] cond={{ 'yes' if c else 'no' }} {{ 'a' if false }}
{% endfor -%}
{%- set ns = namespace(total=0, names=[]) -%}
{%- for message in messages if message.role != 'system' -%}
  {%- set ns.total = ns.total + loop.index -%}
  {%- set ns.names = ns.names + [message.role] -%}
{%- else -%}
  no-non-system
{%- endfor -%}
total={{ ns.total }} names={{ ns.names }} ns={{ ns }}
consts={{ [1, 2.5, 1e20, 1e-7, 0.1 + 0.2, -0.0, 3.0, true, none, 'it\'s', "q\"", 'tab\tx'] }} {{ (1,) }} {{ {'a': [1, {'b': none}]} }}
range={{ range(3)|list }} {{ range(10, 0, -3)|list }} {{ range(5) }} {{ range(2, 9, 3) }} sum={{ [1, 2.5, 3]|sum }} max={{ [3, 1, 2]|max }} min={{ ['b', 'A', 'c']|min }}
dict={{ dict(a=1, b=[2]) }} {{ {'k': 'v'}.items() }} {{ {'k': 'v'}.values() }} tools={{ tools|tojson if tools else 'none' }}
{%- if add_generation_prompt %} gp{{ '!' * 3 }}{% endif %}"""

TEMPLATES = {
    "qwen3": QWEN3,
    "qwen3_coder": QWEN3_CODER,
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v31": DEEPSEEK_V31,
    "kimi_k2": KIMI_K2,
    "mixtral": MIXTRAL,
    "mistral_tools": MISTRAL_TOOLS,
    "whitespace": WHITESPACE,
    "expressions": EXPRESSIONS,
}
# The templates that read enable_thinking / thinking.
THINKING = {"qwen3", "deepseek_v31", "expressions"}

# ---------------------------------------------------------------------------------------
# Conversations.

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "  Current weather for a city.\n",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web — returns snippets «quoted».",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "number", "default": 1.0, "minimum": 0.5, "maximum": 1e10,
                          "multipleOf": 1e-7, "examples": [2.5, 10, -0.0]},
                "filters": {"type": "object", "properties": {"site": {"type": ["string", "null"]}},
                            "nullable": True},
            },
        },
        "return": {"type": "array"},
    },
}


def call(name, args, cid="call00001", as_string=False):
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if as_string else args}}


def conversations():
    """(name, messages, tools): system / none, multi-turn, tool calls with object and
    string arguments, several tool results, empty content, content lists, unicode,
    reasoning in content and in reasoning_content, None values (dropped)."""
    c = []
    c.append(("user", [{"role": "user", "content": "Hello, who are you?"}], None))
    c.append(("system_user", [{"role": "system", "content": "You are terse."},
                              {"role": "user", "content": "What is 2+2?"}], None))
    c.append(("multi", [{"role": "system", "content": "Be kind."},
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello! How can I help?"},
                        {"role": "user", "content": "Tell me a joke."}], None))
    c.append(("multi_answered", [{"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello."},
                                 {"role": "user", "content": "Bye"},
                                 {"role": "assistant", "content": "Goodbye!"}], None))
    c.append(("think_in_content", [{"role": "user", "content": "Why?"},
                                   {"role": "assistant", "content": "<think>\nLet me think.\nStep 2.\n</think>\n\nBecause."},
                                   {"role": "user", "content": "And then?"},
                                   {"role": "assistant", "content": "<think>more</think>Then this."}], None))
    c.append(("reasoning_field", [{"role": "user", "content": "Compute."},
                                  {"role": "assistant", "content": "42", "reasoning_content": "\n6*7\n"}], None))
    c.append(("tools_obj", [{"role": "system", "content": "Use tools."},
                            {"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris", "days": 3})]},
                            {"role": "tool", "tool_call_id": "call00001", "content": "{\"temp\": 21.5}"},
                            {"role": "assistant", "content": "It is 21.5 °C."}], [WEATHER, SEARCH]))
    c.append(("tools_str", [{"role": "user", "content": "Search for jinja"},
                            {"role": "assistant", "content": "Let me look.", "tool_calls": [call("search", {"query": "jinja", "limit": 2.0}, "callABCDE", True)]},
                            {"role": "tool", "tool_call_id": "callABCDE", "content": "result one"}], [SEARCH]))
    c.append(("multi_tool", [{"role": "user", "content": "Both cities"},
                             {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Oslo"}, "call00001", True),
                                                                                    call("get_weather", {"city": "Lima", "unit": "fahrenheit"}, "call00002", True)]},
                             {"role": "tool", "tool_call_id": "call00001", "content": "cold"},
                             {"role": "tool", "tool_call_id": "call00002", "content": "warm"},
                             {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
                             {"role": "assistant", "content": "Done."}], [WEATHER]))
    c.append(("tool_then_gen", [{"role": "user", "content": "Go"},
                                {"role": "assistant", "content": "", "tool_calls": [call("search", {"query": "x", "nested": {"a": [1, 2, {"b": None}]}}, "abcdefghi")]},
                                {"role": "tool", "tool_call_id": "abcdefghi", "content": "42"}], [SEARCH]))
    c.append(("empty", [{"role": "user", "content": ""}], None))
    c.append(("empty_turns", [{"role": "system", "content": ""},
                              {"role": "user", "content": ""},
                              {"role": "assistant", "content": ""},
                              {"role": "user", "content": " "}], None))
    c.append(("parts", [{"role": "user", "content": [{"type": "text", "text": "Look at "},
                                                     {"type": "image", "image": "img.png"},
                                                     {"type": "text", "text": "this."}]}], None))
    c.append(("unicode", [{"role": "system", "content": "Réponds en français. Ελληνικά ΟΔΟΣ. Кириллица."},
                          {"role": "user", "content": "Emoji 😀🎉, CJK 漢字かな, RTL עברית العربية, combining é, nbsp\u00a0x, zero\u200bwidth"},
                          {"role": "assistant", "content": "Straße ß İstanbul ǅ ﬁ"},
                          {"role": "user", "content": "Quotes ' \" `, backslash \\ \\n, tab\tx, ctrl \x01\x1f\x7f, crlf\r\nend"}], None))
    c.append(("names", [{"role": "user", "name": "alice", "content": "From Alice"},
                        {"role": "assistant", "name": "bot", "content": "Hi Alice"},
                        {"role": "user", "content": "Thanks"}], None))
    c.append(("bad_roles", [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}], None))
    c.append(("bad_role_name", [{"role": "user", "content": "a"}, {"role": "critic", "content": "b"}], None))
    c.append(("long", [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * (i % 7)}
                       for i in range(24)], None))
    c.append(("system_only", [{"role": "system", "content": "Only a system prompt."}], None))
    c.append(("two_systems", [{"role": "system", "content": "First rule."},
                              {"role": "system", "content": "Second rule."},
                              {"role": "user", "content": "Go"}], None))
    rng = random.Random(7)
    alphabet = list("abcdefghij ABCDE\n\t.,!?'\"<>{}%#-_") + ["é", "Σ", "ж", "😀", "漢", "\\", " ", "{{", "{%"]
    for k in range(6):
        msgs = []
        for i in range(rng.randint(1, 6)):
            role = "user" if i % 2 == 0 else "assistant"
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
            msgs.append({"role": role, "content": text})
        c.append((f"random{k}", msgs, [WEATHER] if k % 2 else None))
    return c


# ---------------------------------------------------------------------------------------
# Random templates: expressions, statements (scoping, loops, macros, namespaces) and
# whitespace control, from fixed seeds, each rendered once with RANDOM_CTX.

RANDOM_CTX = {"messages": [{"role": "system", "content": "Sys ΣΑΣ"}, {"role": "user", "content": "Hi there, Ωmega! 1.5"},
                           {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [1.5, None]}}}]},
                           {"role": "tool", "content": [{"type": "text", "text": "part"}]}],
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": 1.0}}}],
              "xs": [1, 2, 3], "v": "ctx", "n": 7, "f": 2.5, "s": "Hello World", "e": "", "z": 0, "b": True,
              "nn": None, "l": [3, 1, 2], "d": {"k": "v", "n": 2}}


def random_expressions(rng, count):
    strs = ["'a'", "'Hello'", "''", "' x y '", "'a,b,,c'", "'é'", "'ΣΑΣ'", "'\\n'", "'it\\'s'", "'\"q\"'", "'ß'", "'3'",
            "'2.5'", "' 7 '", "'0x1f'", "'-3'", "'abcabc'", "'<b>&'"]
    nums = ["0", "1", "-1", "2", "3", "7", "2.5", "-0.5", "1e3", "0.1", "10", "1e20", "True", "False"]
    names = ["n", "f", "s", "e", "z", "b", "nn", "l", "d", "messages", "messages[1]", "messages[1].content",
             "messages[2].tool_calls", "messages[2].tool_calls[0].function.arguments", "tools", "undefined_x",
             "messages[3].content", "d.k"]
    filters = [("length", []), ("string", []), ("trim", []), ("upper", []), ("lower", []), ("capitalize", []),
               ("title", []), ("first", []), ("last", []), ("list", []), ("sort", []), ("unique", []),
               ("join", ["', '"]), ("tojson", []), ("tojson", ["indent=2"]), ("tojson", ["sort_keys=true"]), ("int", []),
               ("float", []), ("abs", []), ("default", ["'D'"]), ("default", ["'D'", "true"]), ("replace", ["'a'", "'b'"]),
               ("items", []), ("safe", []), ("max", []), ("min", []), ("sum", []), ("map", ["'string'"]),
               ("map", ["attribute='role'"]), ("select", []), ("reject", ["'odd'"]), ("selectattr", ["'role'"]),
               ("rejectattr", ["'role'", "'eq'", "'user'"])]
    tests = ["defined", "undefined", "none", "string", "number", "integer", "float", "mapping", "iterable",
             "sequence", "boolean", "true", "false", "odd", "even", "divisibleby 3", "in l", "eq 3", "lower"]
    methods = [("startswith", ["'H'"]), ("endswith", ["'d'"]), ("split", []), ("split", ["','"]),
               ("rsplit", ["' '", "1"]), ("strip", []), ("lstrip", ["'H'"]), ("replace", ["'l'", "'L'"]),
               ("upper", []), ("title", []), ("find", ["'o'"]), ("count", ["'l'"]), ("splitlines", []),
               ("get", ["'k'"]), ("get", ["'zz'", "5"]), ("items", []), ("keys", [])]
    ops = ["+", "-", "*", "/", "//", "%", "~", "==", "!=", "<", "<=", ">", ">=", "in", "not in", "and", "or", "**"]

    def atom(d):
        r = rng.random()
        if r < 0.25: return rng.choice(strs)
        if r < 0.45: return rng.choice(nums)
        if r < 0.75: return rng.choice(names)
        if r < 0.82: return "[" + ", ".join(expr(d + 1) for _ in range(rng.randint(0, 3))) + "]"
        if r < 0.87: return "(" + ", ".join(expr(d + 1) for _ in range(rng.randint(1, 2))) + ",)"
        if r < 0.92: return "{" + ", ".join(rng.choice(strs) + ": " + expr(d + 1) for _ in range(rng.randint(0, 2))) + "}"
        return rng.choice(["none", "true", "range(4)", "range(1, 7, 2)", "dict(x=1)"])

    def expr(d=0):
        if d > 3: return atom(d)
        r = rng.random()
        if r < 0.3: return atom(d)
        if r < 0.5: return "(" + expr(d + 1) + " " + rng.choice(ops) + " " + expr(d + 1) + ")"
        if r < 0.62:
            f, a = rng.choice(filters)
            return "(" + expr(d + 1) + ")|" + f + ("(" + ", ".join(a) + ")" if a else "")
        if r < 0.7: return "(" + expr(d + 1) + " is " + rng.choice(["", "not "]) + rng.choice(tests) + ")"
        if r < 0.78:
            m, a = rng.choice(methods)
            return "(" + expr(d + 1) + ")." + m + "(" + ", ".join(a) + ")"
        if r < 0.84: return "(" + expr(d + 1) + ")[" + rng.choice(["0", "1", "-1", "'k'", "'role'", "1:", ":-1", "::-1", "::2", "5"]) + "]"
        if r < 0.88: return "(" + expr(d + 1) + " if " + expr(d + 1) + " else " + expr(d + 1) + ")"
        if r < 0.94: return "(not " + expr(d + 1) + ")"
        return "(-" + expr(d + 1) + ")"

    return ["{{ " + expr() + " }}" for _ in range(count)]


def random_statements(rng, count):
    def expr():
        return rng.choice(["a", "b", "v", "x", "i", "n", "m", "m.role", "loop.index", "loop.last", "ns.k", "ns.l",
                           "1", "'s'", "a ~ b", "(x or 0) + 1", "xs|length", "messages[0].content", "loop.previtem",
                           "f(1)", "f(a)", "g()", "ns.k + 1", "[a, b]", "i * 2", "x is defined", "a if b else v"])

    def stmt(d):
        r = rng.random()
        if r < 0.3: return "{{ " + expr() + " }}"
        if r < 0.5:
            return "{% set " + rng.choice(["a", "b", "v", "x", "i", "m", "n", "xs", "ns.k", "ns.l"]) + " = " + expr() + " %}"
        if d > 2: return "."
        if r < 0.68:
            return ("{% for " + rng.choice(["i", "x", "m", "a"]) + " in " + rng.choice(["xs", "messages", "range(2)", "[]"])
                    + rng.choice(["", " if " + expr()]) + " %}" + body(d + 1) + rng.choice(["", "{% else %}E" + body(d + 1)])
                    + "{% endfor %}")
        if r < 0.8:
            return ("{% if " + expr() + " %}" + body(d + 1) + rng.choice(["", "{% elif " + expr() + " %}" + body(d + 1)])
                    + rng.choice(["", "{% else %}" + body(d + 1)]) + "{% endif %}")
        if r < 0.86: return rng.choice(["{% break %}", "{% continue %}"]) if d > 0 else "-"
        if r < 0.93: return "{% set " + rng.choice(["a", "b"]) + " %}" + body(d + 1) + "{% endset %}"
        return rng.choice(["{{ f(" + expr() + ") }}", "{{ g() }}", "{% set ns.l = ns.l + [" + expr() + "] %}"])

    def body(d):
        return "".join(stmt(d) for _ in range(rng.randint(1, 4)))

    head = ("{% macro f(p, q=a) %}<{{ p }}{{ q }}{{ v }}{% set v = 'mv' %}{{ v }}>{% endmacro %}"
            "{% macro g() %}[{{ a }}]{% endmacro %}{% set ns = namespace(k=0, l=[]) %}")
    return [head + body(0) + "|{{ a }}{{ b }}{{ v }}{{ x }}{{ i }}{{ ns.k }}" for _ in range(count)]


def random_whitespace(rng, count):
    text = ["", " ", "  ", "\t", "\n", "\n\n", " \n", "\n  ", "x", "ab c", "\r\n", "\r", " \t\n\t ", "\u00a0",
            "\u3000\n", "é", "{", "}", "#", "%", "-", "+"]

    def ws(): return rng.choice(["", " ", "  ", "\n", " \n ", "\t"])
    def sign(): return rng.choice(["", "", "-", "+"])

    def tag():
        r = rng.random()
        if r < 0.25: return "{{" + sign() + ws() + rng.choice(["v", "'s'", "n", "n + 1"]) + ws() + rng.choice(["", "-"]) + "}}"
        if r < 0.4: return "{#" + sign() + rng.choice(["", " c ", "\n", "-"]) + rng.choice(["", "-", "+"]) + "#}"
        if r < 0.5: return "{%" + sign() + ws() + "set y = 1" + ws() + sign() + "%}"
        if r < 0.6:
            return ("{%" + sign() + " raw " + sign() + "%}" + rng.choice(text) + "{{ v }}" + rng.choice(text)
                    + "{%" + sign() + " endraw " + sign() + "%}")
        return None

    def block(d):
        out = []
        for _ in range(rng.randint(1, 4)):
            out.append(rng.choice(text) * rng.randint(0, 2))
            t = tag()
            if t:
                out.append(t)
                continue
            if d > 2: continue
            kind = rng.choice(["if", "for"])
            head = "if n > 0" if kind == "if" else "for i in [1, 2]"
            out.append("{%" + sign() + ws() + head + ws() + sign() + "%}" + block(d + 1)
                       + ("{%" + sign() + " else " + sign() + "%}" + block(d + 1) if rng.random() < 0.3 else "")
                       + "{%" + sign() + " end" + kind + " " + sign() + "%}")
        return "".join(out)

    return [block(0) + rng.choice(["", "\n", "\n\n", " "]) for _ in range(count)]


def known_difference(ref_text, our_tag, our_body):
    """The documented differences: Python prints a memory address (generators, methods),
    integers beyond 64 bits, and refused constructs."""
    if ref_text is not None and (" at 0x" in ref_text or " AT 0X" in ref_text or "<generator" in ref_text
                                 or "<built-in" in ref_text):
        return True
    return our_tag in ("ERR", "CERR") and ("64 bits" in our_body or "64-bit" in our_body
                                          or "not supported" in our_body
                                          or "cannot print a" in our_body)


def run_pairs(cli, cases, keep):
    fd, path = tempfile.mkstemp(suffix=".pairs", dir=keep)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
        for src, ctx in cases:
            f.write(json.dumps(src) + "\t" + json.dumps(ctx, ensure_ascii=True) + "\n")
    p = subprocess.run([cli, "--pairs", path], capture_output=True, timeout=300)
    if not keep:
        os.unlink(path)
    if p.returncode != 0:
        raise RuntimeError(f"tmpl_cli exited {p.returncode}: {p.stderr.decode(errors='replace')}")
    return parse_records(p.stdout)


# ---------------------------------------------------------------------------------------
# Running both sides.

def oracle(template, messages, tools, agp, extra):
    """What apply_chat_template renders, and the variables the template saw."""
    chat = ctu._normalize_chat_messages(copy.deepcopy(messages))
    kwargs = {"bos_token": BOS, "eos_token": EOS, **extra}
    try:
        rendered, _ = ctu.render_jinja_template(conversations=[chat], tools=copy.deepcopy(tools),
                                                chat_template=template, add_generation_prompt=agp,
                                                **copy.deepcopy(kwargs))
        result = ("OK", rendered[0])
    except Exception as exc:  # noqa: BLE001
        result = ("ERR", f"{type(exc).__name__}: {exc}", exc)
    # The variables as render_jinja_template passes them to the template.
    seen = ctu._alias_reasoning_fields(ctu._plain_template_data(chat))
    variables = {"messages": seen, "tools": ctu._plain_template_data(tools), "documents": None,
                 "add_generation_prompt": agp, **ctu._plain_template_data(kwargs)}
    return result, variables


def has_float(x):
    if isinstance(x, float):
        return True
    if isinstance(x, dict):
        return any(has_float(v) for v in x.values())
    if isinstance(x, list):
        return any(has_float(v) for v in x)
    return False


def run_cli(cli, template, contexts, use_cjson, keep):
    """Renders every context with one tmpl_cli --batch call; returns the records."""
    fd, path = tempfile.mkstemp(suffix=".jsonl", dir=keep)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(json.dumps(template) + "\n")
        for ctx in contexts:
            f.write(json.dumps(ctx, ensure_ascii=True) + "\n")
    args = [cli] + (["--cjson"] if use_cjson else []) + ["--batch", path]
    p = subprocess.run(args, capture_output=True, timeout=120)
    if not keep:
        os.unlink(path)
    if p.returncode != 0:
        raise RuntimeError(f"tmpl_cli exited {p.returncode}: {p.stderr.decode(errors='replace')}")
    return parse_records(p.stdout)


def parse_records(out):
    """tmpl_cli's records: (tag, code name, text)."""
    recs, i = [], 0
    while i < len(out):
        nl = out.index(b"\n", i)
        tag, name, n = out[i:nl].decode().split(" ")
        body = out[nl + 1: nl + 1 + int(n)]
        recs.append((tag, name, body.decode("utf-8", "surrogatepass")))
        i = nl + 1 + int(n) + 1
    return recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", default=os.path.join(os.environ.get("BUILD", "build"), "tests", "tmpl_cli"))
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--keep", default=None, help="keep the batch files in this directory")
    ap.add_argument("--only", default=None, help="comma list of template names")
    args = ap.parse_args()
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    passed = failed = 0
    stats = {}

    def report(ok, what, detail=""):
        nonlocal passed, failed
        if ok:
            passed += 1
            if args.verbose:
                print(f"ok   {what}")
        else:
            failed += 1
            print(f"FAIL {what}{': ' + detail if detail else ''}")

    convs = conversations()
    names = args.only.split(",") if args.only else list(TEMPLATES)
    for tname in names:
        template = TEMPLATES[tname]
        cases = []
        for cname, messages, tools in convs:
            for agp in (False, True):
                extras = [{}]
                if tname in THINKING:
                    extras = [{}, {"enable_thinking": True}, {"enable_thinking": False}]
                for extra in extras:
                    result, variables = oracle(template, messages, tools, agp, extra)
                    cases.append((f"{tname}/{cname}/agp={int(agp)}/{json.dumps(extra)}", result, variables))
        n_ok = n_err = 0
        for use_cjson in (False, True):
            sel = [c for c in cases if not use_cjson or not has_float(c[2])]
            if use_cjson:
                sel = sel[::2]  # half the float-free contexts again, through cJSON
            recs = run_cli(args.cli, template, [c[2] for c in sel], use_cjson, args.keep)
            if len(recs) == 1 and recs[0][0] == "CERR":
                report(False, f"{tname}: refused", recs[0][2])
                break
            for (what, result, _), (tag, code, body) in zip(sel, recs):
                what = what + ("/cjson" if use_cjson else "")
                if result[0] == "OK":
                    ok = tag == "OK" and body == result[1]
                    n_ok += ok
                    detail = "" if ok else (f"ours {tag} {code}: {body[:300]!r}\n   jinja2: {result[1][:300]!r}"
                                            if tag != "OK" else first_diff(result[1], body))
                    report(ok, what, detail)
                else:
                    exc = result[2]
                    if type(exc).__name__ == "TemplateError":  # raise_exception
                        ok = tag == "ERR" and code == "MR_EPRECOND" and body == str(exc)
                    else:
                        ok = tag == "ERR"
                    n_err += ok
                    report(ok, what, "" if ok else f"jinja2 failed ({result[1][:200]}), ours {tag} {code}: {body[:200]!r}")
        stats[tname] = (n_ok, n_err)

    # Random templates against jinja2 directly (the environment of transformers).
    rng = random.Random(20260101)
    env_compile = ctu._compile_jinja_template
    rnd = ([("expr", s) for s in random_expressions(rng, 400)] + [("stmt", s) for s in random_statements(rng, 400)]
           + [("ws", s) for s in random_whitespace(rng, 300)])
    refs = []
    for _, src in rnd:
        try:
            refs.append(("OK", env_compile(src).render(**RANDOM_CTX)))
        except Exception as exc:  # noqa: BLE001
            refs.append(("ERR", f"{type(exc).__name__}: {exc}"))
    recs = run_pairs(args.cli, [(src, RANDOM_CTX) for _, src in rnd], args.keep)
    rstats = {"expr": [0, 0, 0], "stmt": [0, 0, 0], "ws": [0, 0, 0]}  # identical, failures matched, skipped
    for (kind, src), ref, (tag, code, body) in zip(rnd, refs, recs):
        if known_difference(ref[1] if ref[0] == "OK" else None, tag, body):
            rstats[kind][2] += 1
            continue
        if ref[0] == "OK":
            ok = tag == "OK" and body == ref[1]
            rstats[kind][0] += ok
            report(ok, f"random {kind}: {src[:80]!r}",
                   "" if ok else f"jinja2 {ref[1][:200]!r}, ours {tag} {code}: {body[:200]!r}")
        else:
            ok = tag in ("ERR", "CERR")
            rstats[kind][1] += ok
            report(ok, f"random {kind}: {src[:80]!r}", "" if ok else f"jinja2 failed ({ref[1][:150]}), ours {tag}: {body[:200]!r}")

    # Refusals: each names the construct and its line.
    refusals = [
        ('{% include "other.jinja" %}', '"include" is not supported', 1),
        ('text\n{% extends "base.jinja" %}', '"extends" is not supported', 2),
        ('{% macro m() %}{{ caller() }}{% endmacro %}\n\n{% call m() %}x{% endcall %}', '"caller" in a macro', 1),
        ('a\nb\n{% call m() %}x{% endcall %}', '"call" is not supported', 3),
        ('{% filter upper %}x{% endfilter %}', '"filter" is not supported', 1),
        ('{{ messages|wordwrap }}', 'filter "wordwrap" is not supported', 1),
        ('{% if x is odd_ish %}{% endif %}', 'test "odd_ish" is not supported', 1),
        ("\n\n  {{ '{}'.format(x) }}", 'method "format" is not supported', 3),
        ('{% do x.append(1) %}', '"do" is not supported', 1),
        ('{% for x in y recursive %}{% endfor %}', '"recursive" loops are not supported', 1),
        ('{% with a = 1 %}{% endwith %}', '"with" is not supported', 1),
        ('{{ lipsum() }}', '"lipsum()" is not supported', 1),
        ('{% block b %}{% endblock %}', '"block" is not supported', 1),
        ('{% import "m.j" as m %}', '"import" is not supported', 1),
        ('{% for x in xs %}\n{% macro m() %}{% endmacro %}{% endfor %}', '"macro" inside a for loop', 2),
        ('{{ messages|selectattr("role", "matches", "u") }}', 'test "matches" is not supported', 1),
        ('{% macro f(a) %}{% endmacro %}{{ f(*args) }}', '"*args" arguments are not supported', 1),
        ('{{ "\\N{BULLET}" }}', '\\N{...} escapes are not supported', 1),
    ]
    rec = run_refusals(args.cli, refusals, args.keep)
    for (src, want, line), got in zip(refusals, rec):
        tag, code, msg = got
        ok = tag == "CERR" and code == "MR_ENOTSUP" and want in msg and msg.startswith(f"chat_template:{line}:")
        report(ok, f"refuse {want}", "" if ok else f"got {tag} {code}: {msg}")

    for tname, (n_ok, n_err) in stats.items():
        print(f"  {tname:14s} {n_ok:4d} byte-identical renderings, {n_err:3d} failures matched")
    for kind, (n_ok, n_err, n_skip) in rstats.items():
        print(f"  random {kind:7s} {n_ok:4d} byte-identical renderings, {n_err:3d} failures matched, "
              f"{n_skip:3d} known differences skipped")
    print(f"test_chat_template_jinja: {passed} passed, {failed} failed")
    return 1 if failed else 0


def run_refusals(cli, refusals, keep):
    out = []
    for src, _, _ in refusals:
        recs = run_cli(cli, src, [{}], False, keep)
        out.append(recs[0] if recs else ("NONE", "", ""))
    return out


def first_diff(want, got):
    i = 0
    while i < min(len(want), len(got)) and want[i] == got[i]:
        i += 1
    return (f"differ at char {i} of {len(want)} / {len(got)}:\n   jinja2: {want[max(0, i - 40):i + 60]!r}"
            f"\n   ours:   {got[max(0, i - 40):i + 60]!r}")


if __name__ == "__main__":
    sys.exit(main())
