"""The filesystem process: its folders top to bottom, each importing only those below it."""
