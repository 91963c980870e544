"""Reading where ranks are and how fast they move: stall and straggler reports."""
