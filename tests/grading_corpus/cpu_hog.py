# 16 busy processes and no --cpu-time given: a row of 48 once made the honest row beside it time out; the default CPU budget stops it
import os
for _ in range(16):
    if os.fork() == 0:
        break
while True:
    pass
