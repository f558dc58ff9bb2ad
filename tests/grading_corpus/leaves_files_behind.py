# files in the shared /tmp, /var/tmp and /dev/shm: they outlived the row, and the next batch's row with the same uid read them
import os
for _folder in ("/tmp", "/var/tmp", "/dev/shm"):
    try:
        with open(os.path.join(_folder, "dtlib-corpus-leftover"), "w") as _f:
            _f.write("x" * 1000)
    except OSError:
        pass
