"""What the user sees: the console and rank logs, folding, the notebook table, the status
line, summaries, messages and notices."""
