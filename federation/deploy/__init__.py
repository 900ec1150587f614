"""Deployment tools, apart from the app: provisioning, the multi-process demo, the operator commands.

``python -m federation.deploy.provision`` writes startup kits (``federation.deploy.provisioning``);
``federation.deploy.check`` checks a run config, hands a local ``flwr run`` only to a SuperLink
this FLWR_HOME started (``federation.deploy.local_superlink``; ``federation.deploy.port_owner``
says who holds a port) and gives ``flwr run`` an exit status; ``federation.deploy.stop`` stops
that SuperLink by pid; ``federation.deploy.clean`` lists and removes past runs' node
directories. The app (``federation/``) imports none of them.

The demo, a real multi-process Flower deployment on this machine (TLS, SuperNode auth, a crash):

``python -m federation.deploy demo --nodes 5 --rounds 3 --kill-one`` provisions startup kits
(``federation.deploy.provisioning``), starts one ``flower-superlink`` (TLS + ``--enable-supernode-auth``) on a
free loopback port with a private FLWR_HOME and database, registers every node's auth key,
shows that an unregistered key and a wrong root certificate are refused, starts N
``flower-supernode`` processes, runs the app with ``flwr run --stream`` and, with
``--kill-one``, SIGKILLs the highest partition's SuperNode (its whole process family) once it
has received its train message of round R-1 of R (``kill_round``: the round before the last,
so the key rotation that follows is seen; round 1 with ``--rounds`` 1 or 2). The run must
finish with the survivors.

Kits, logs (``logs/``) and results (``results/``) go to ``--workdir DIR``, kept; without it to
a temporary directory that is removed at the end unless ``--keep``. The last progress line
says which (``workdir_note``).

Every process is started in its own session and tracked by (pid, start time), with its
descendants; all are stopped by pid on success, failure, SIGINT and SIGTERM. The last stdout
line is one JSON object (see ``summary``); progress goes to stderr.

``--serve`` (with ``--task lm``) starts the OpenAI-compatible server (``python -m
node.serving.openai_api --backend scheduler --cache-dir ...``) beside SuperNode 0, on that node's cache
directory: each write-back of the node invalidates it and it loads the new parameters between
scheduler steps; the summary's ``serve_agent`` shows the model versions its streamed replies
(``system_fingerprint``) and ``/v1/models`` reported. Its client (plain HTTP) authenticates
with the bearer token the server writes on first start (``serve-token`` beside that cache
directory).

``--netns`` puts each SuperNode in a network namespace of its own (``fedkv-<tag>-<i>``), joined
by a veth pair to a bridge the command creates on the host (10.250.<k>.0/24, the first free
<k>); the SuperLink binds the bridge's address 10.250.<k>.1 only. Namespaces, veths and the
bridge are removed at the end.
"""
