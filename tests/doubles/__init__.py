"""Test doubles: stand-ins for third-party servers, run as scripts by the tests that need them.

- ``oracle_chat_server.py``: an OpenAI-compatible chat model that replays task records' gold actions
  (evaluation of ``openai:`` policies, LLM-driven data synthesis).
- ``expert_chat_server.py``: OpenAI-compatible expert endpoints that echo, fail, hang or refuse
  (the tool service's expert client).
"""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
ORACLE_CHAT_SERVER = os.path.join(HERE, "oracle_chat_server.py")
EXPERT_CHAT_SERVER = os.path.join(HERE, "expert_chat_server.py")
