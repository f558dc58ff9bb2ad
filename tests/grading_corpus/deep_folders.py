# 1,500 nested folders in its home: shutil.rmtree recursed once per level and the batch died of RecursionError
import os
os.chdir(os.path.expanduser("~"))
for _ in range(1500):
    os.mkdir("d")
    os.chdir("d")
