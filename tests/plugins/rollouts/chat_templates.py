"""Chat templates written by hand to behave as the model families' own do where multi-turn
training cares (what history they rewrite, how turns open and close, where tools go), and tiny
tokenizers that carry them. Nothing is downloaded."""

from __future__ import annotations

QWEN3 = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
"""Qwen3's hybrid template, cut to its structure: the reasoning of an assistant turn before the
last user message is dropped, a later one is rewritten as ``<think>\\n...\\n</think>\\n\\n``;
``enable_thinking=false`` opens each turn with an empty ``<think>`` block, which history drops."""

QWEN3_THINKING = QWEN3.replace(
    "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    "{{- '<|im_start|>assistant\\n<think>\\n' }}",
)
"""Qwen3-*-Thinking-2507 style: the generation prompt opens the ``<think>`` block, so the policy
writes its reasoning, ``</think>`` and the answer; history keeps only the answer."""

LLAMA3 = """
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}
{%- if tools %}
    {{- 'You have access to the following functions. To call a function, respond with JSON for a function call.' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
    {%- for tool in tools %}{{- tool | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role in ['ipython', 'tool'] %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
"""Llama 3.1's template, cut to its structure: every message's content is trimmed, tools listed
in the system message (its ``tools_in_user_message=false`` form), tool results as ``ipython``."""

MISTRAL = """
{{- bos_token }}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if loop.index0 == ns.last_user and tools %}{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
        {{- '[INST] ' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '[TOOL_CALLS] ' + message.tool_calls | map(attribute='function') | list | tojson + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + message.content | trim + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | tojson + '}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""
"""Mistral's v3 template, cut to its structure: no generation prompt (a prompt ends at
``[/INST]`` or ``[/TOOL_RESULTS]``), an assistant turn written as a space and its trimmed content,
closed by ``</s>``; the tools listed before the last user message."""

DEEPSEEK = """
{{- bos_token }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}
{%- set ns = namespace(is_tool=false) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.is_tool = false %}
        {{- '<｜User｜>' + message.content }}
    {%- elif message.role == 'assistant' %}
        {%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- set ns.is_tool = false %}{%- endif %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}
        {{- '<｜Assistant｜>' + content }}
        {%- if message.tool_calls %}
            {{- '<｜tool▁calls▁begin｜>' }}
            {%- for call in message.tool_calls %}
                {{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call.function.name + '\\n```json\\n' }}
                {{- call.function.arguments | tojson + '\\n```<｜tool▁call▁end｜>' }}
            {%- endfor %}
            {{- '<｜tool▁calls▁end｜>' }}
        {%- endif %}
        {{- '<｜end▁of▁sentence｜>' }}
    {%- elif message.role == 'tool' %}
        {%- if not ns.is_tool %}{{- '<｜tool▁outputs▁begin｜>' }}{%- set ns.is_tool = true %}{%- endif %}
        {{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}
    {%- endif %}
{%- endfor %}
{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}
"""
"""DeepSeek V3's template, cut to its structure: tool outputs gathered between
``<｜tool▁outputs▁begin｜>`` and ``<｜tool▁outputs▁end｜>``, reasoning dropped from past answers
(R1); its tools are described in the system prompt, not by the template."""

GPT_OSS = """
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\nReasoning: medium\\n\\n' }}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}{{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- '<|end|>' }}
{%- if messages[0].role == 'system' or tools %}
    {{- '<|start|>developer<|message|>' }}
    {%- if messages[0].role == 'system' %}{{- '# Instructions\\n\\n' + messages[0].content + '\\n\\n' }}{%- endif %}
    {%- if tools %}
        {{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}
        {%- for tool in tools %}
            {{- '// ' + tool.function.description + '\\ntype ' + tool.function.name + ' = (_: ' }}
            {{- tool.function.parameters | tojson + ') => any;\\n\\n' }}
        {%- endfor %}
        {{- '} // namespace functions' }}
    {%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|start|>assistant' + message.content + ('<|call|>' if ' to=functions.' in message.content else '<|end|>') }}
    {%- elif message.role == 'tool' %}
        {{- '<|start|>functions.' + message.name + ' to=assistant<|channel|>commentary<|message|>' + message.content | tojson + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""
"""gpt-oss's template (the harmony format), cut to its structure: system and developer messages
(the tools in a ``functions`` namespace; gpt-oss writes their parameters as TypeScript, here as
JSON), each message ``<|start|>ROLE<|message|>...<|end|>``, a tool's result from
``functions.NAME to=assistant`` on the commentary channel, the generation prompt
``<|start|>assistant``, after which the policy writes its channels. Where it differs from
gpt-oss's own: a past assistant turn is written as the text the policy wrote (closed by
``<|call|>`` when it called a function), as the rollout passes it; gpt-oss's template rebuilds past
turns from structured fields (``tool_calls``, ``thinking``) the rollout does not pass, and refuses
a tool message without them (docs/multi-turn.md, Tool-call formats)."""

QWEN_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_TOKENS = [
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
MISTRAL_TOKENS = [
    "<|endoftext|>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
]  # fmt: skip
DEEPSEEK_TOKENS = [
    "<|endoftext|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
]  # fmt: skip

GPT_OSS_TOKENS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

FAMILIES = {
    "qwen3": (QWEN3, QWEN_TOKENS, {"eos_token": "<|im_end|>"}),
    "qwen3_thinking": (QWEN3_THINKING, QWEN_TOKENS, {"eos_token": "<|im_end|>"}),
    "llama3": (LLAMA3, LLAMA_TOKENS, {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"}),
    "mistral": (MISTRAL, MISTRAL_TOKENS, {"eos_token": "</s>", "bos_token": "<s>"}),
    "deepseek": (DEEPSEEK, DEEPSEEK_TOKENS, {"eos_token": "<｜end▁of▁sentence｜>", "bos_token": "<｜begin▁of▁sentence｜>"}),
    "gpt_oss": (GPT_OSS, GPT_OSS_TOKENS, {"eos_token": "<|return|>"}),
}
"""Per family: its chat template, its special tokens, which of them are eos and bos."""


def build_chat_tokenizer(family: str):
    """A byte-level BPE (500 tokens) trained here, with the special tokens and chat template of ``family``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, special_tokens, specials = FAMILIES[family]
    corpus = [
        f"what is {a} plus {b}? <think>\nadd {a} and {b}\n</think>\n\nThe answer is {a + b}. "
        '{"name": "calculator", "arguments": {"expression": "1 + 2"}} Incorrect, try again.'
        for a in range(30)
        for b in range(30)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=500, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", **specials)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in special_tokens if t not in specials.values()]})
    tokenizer.chat_template = template
    return tokenizer


def build_chat_model(path, family: str, seed: int = 0):
    """A random 2-layer Qwen3 model with ``build_chat_tokenizer(family)``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_chat_tokenizer(family)
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
