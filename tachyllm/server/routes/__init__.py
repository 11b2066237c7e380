"""The server's routes, one module per group, each an APIRouter that build_app includes: service (the open
probes, metrics and API description), models, completions, chat, tokenize."""
