"""grpo_core.remote: code that talks to other processes.

The HTTP client of OpenAI-compatible servers, the Tinker SDK's calls, the vLLM worker extension and
the agent gateway live here, apart from the plugins that use them: a plugin of any kind imports
what it needs from this package, never from another plugin. No hooks are declared or implemented
here, and nothing here imports a plugin (`tests/core/test_imports.py`).
"""
