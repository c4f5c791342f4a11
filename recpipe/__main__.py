from recpipe.cli import main_entry

main_entry()
