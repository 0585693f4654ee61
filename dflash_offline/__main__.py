from dflash_offline.cli import main

main()
