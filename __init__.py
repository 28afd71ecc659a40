"""skilltrain: hands-off skill training of an LLM screenwriter.

The checkout is the `skilltrain` package: `daemon/` is `skilltrain.daemon`,
`handlers/` is `skilltrain.handlers`. Inside them imports are relative
(`from . import config`, `from ..handlers import loss`), so each names the
file it loads by its path from the importing file. README "How the code is
laid out" says where each concept lives.
"""
