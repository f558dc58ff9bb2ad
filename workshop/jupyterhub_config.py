"""JupyterHub for a workshop room: the dtlib course for every learner, per-learner CPU/memory caps.

    make workshop            # or: cd .workshop && jupyterhub -f ../workshop/jupyterhub_config.py

Every setting below is an ordinary JupyterHub trait, so any of them can be changed on the command
line (``--Spawner.cpu_limit=2``) or in a ``jupyterhub_config.py`` of the room's own that loads this
one (``load_subconfig``). State (the user database, the cookie secret, the proxy's pid file and,
with :class:`SharedAccountSpawner`, the learners' homes) is written in the working folder.
See docs/workshop.md for sizing and for the choice of authenticator.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the hub imports the spawner from workshop/ of this checkout

from workshop import spawner  # noqa: E402

c = get_config()  # noqa: F821 - defined by JupyterHub when it loads this file

c.JupyterHub.bind_url = "http://:8000"
# Each learner a system account (uid isolation); the instructor creates the accounts beforehand
# and learners log in with their password (PAM, JupyterHub's default authenticator).
c.JupyterHub.spawner_class = spawner.WorkshopSpawner
c.JupyterHub.shutdown_on_logout = True  # logging out stops the server, its kernels and their ranks
c.ConfigurableHTTPProxy.command = [os.path.join(ROOT, "workshop", "node_modules", ".bin", "configurable-http-proxy")]

c.Spawner.pre_spawn_hook = spawner.install_course
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]  # this environment's Jupyter and dtlib
c.Spawner.default_url = f"/lab/tree/{spawner.FIRST_LESSON}"
# Sized from docs/workshop.md's table: the heaviest lesson's peak memory with headroom, one core
# each (a lesson's ranks are CPU-bound; with fewer cores it runs slower, not wrong).
c.Spawner.cpu_limit = 1.0
c.Spawner.mem_limit = "3G"
c.Spawner.http_timeout = 120  # a loaded machine starts JupyterLab slowly
c.Spawner.start_timeout = 180
