"""``python -m fully_shard.switch SCRIPT [ARGS...]``: run a script (or ``-m MODULE``) with torch's FSDP2 names
switched to fully_shard's (see :func:`fully_shard.switch.main`)."""

from fully_shard.switch import main

main()
