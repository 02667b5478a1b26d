"""What the tests and the benchmarks share: the Llama-style model they train (``llama.py``), the tracker of live
tensor storages that measures their memory (``storages.py``), the recorder of the collectives a process issues
(``collectives.py``) and process hygiene (``processes.py``). Neither is part of the library; ``tests/`` never imports
``benchmarks/``, and both import this."""
