"""Built-in offline tasks: prompts made in code, rewards and environments, and the tiny checkpoints.

``digits`` (the quickstart: answer with the prompt's digits, ``DigitsDataModule`` and
``DigitsReward``), ``reveal`` (a multi-turn task whose digits come only from the environment),
``sandbox`` (the reveal task answered by a slow subprocess, ``async def`` steps), ``arithmetic``
(a calculator tool and a reward for the answer), ``math_answer`` (math with verifiable answers,
GSM8K's ``#### N`` lines included, compared by ``math-verify``; ``math_reading`` reads the answers,
``math_checkers`` checks a batch in worker processes within a time bound) and ``tiny`` (random GPT-2
policies, reward models and tokenizers built from configs and saved with ``save_pretrained``,
which ``lightning-ppo make-tiny`` writes). Nothing here downloads; the example configs and the
tests name these by import path. May import the public face's ``data``, ``rewards`` and ``scoring``,
``rollout/`` and ``runs/``; nothing of the package imports it but ``cli`` (``make-tiny``).
"""
