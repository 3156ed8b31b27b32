"""Keeping a run safe: one-line errors for the user's mistakes (``errors``, ``typos``,
``data_files``) and one-line warnings (``warn``), checks before anything loads (``preflight``),
atomic checkpoint files, locks and file modes (``checkpoint_io``, ``run_lock``, ``writable``,
``file_modes``, ``processes``), exact resume and its logs (``resume``, ``log_continuity``,
``run_length``), Ctrl-C and silenced noise (``ctrl_c``, ``quiet``), and the user's slow calls run
together within a time limit (``bounded_calls``, on ``background_loop`` and ``call_threads``). The
bottom of the package: imports nothing of it but ``config``.
"""
