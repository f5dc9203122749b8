"""Where we mend hivemind 1.1.12, all in one place: for each fix, what hivemind does wrong, the test that reproduces
it, and when the fix can go. Importing this package installs the global ones; the others are classes and options
that the swarm code uses explicitly.

- :mod:`.numpy_decode`: hivemind's 8-bit decompression calls ``int()`` on a one-element array, an error since NumPy
  2.4, so all-reduce silently averages partial results. Reproduced by ``tests/test_trainer_compression.py``
  (``test_compat_fix_is_needed_and_installed`` and the 8-bit round trips). Drop when hivemind reads its headers as
  scalars (not fixed in 1.1.12) or NumPy < 2.4 is pinned.
- :mod:`.averagers`: a cancelled averaging round can (a) be garbage-collected half-way and leave the peer out of
  every later round, and (b) average anyway with weight 1 and stale buffers. Reproduced deterministically by
  ``tests/test_averagers.py`` against hivemind's own averagers. Drop when hivemind keeps its cancelled matchmaking
  tasks referenced and marks a step cancelled before signalling its averager. And (c) a leaving trainer waits, up to
  the round's timeouts, for the parameter round its delayed step holds or is about to begin (CI: 20 s to exit);
  ``SwarmOptimizer.shutdown`` gives up every round without a group, also those begun after it
  (:class:`.averagers.LeavesUngrouped`; ``tests/test_swarm_optimizer.py``, the leaver, in both orders). Drop when
  hivemind's shutdown stops its delayed step.
- :mod:`.quiet_logs`: hivemind logs a round that found no group, was cancelled or lost a groupmate, torch's
  resource sharer a peer that left during the DHT's shutdown, and its p2p handler a peer that reset a connection
  mid-request, with tracebacks; here they are one line each
  (tracebacks with ``HIVEMIND_LOGLEVEL=DEBUG``). Checked by the log assertions of ``tests/test_large_swarm.py`` and
  ``tests/test_diloco_swarm.py``. Drop when hivemind logs expected round failures without a traceback.
- Averager options (in :class:`lean_transformer.swarm.averaging.optimizer.SwarmOptimizer`): hivemind passes
  ``averager_opts`` to the state averager only; the swarm optimizer gives them to its gradient averager too. Drop
  when hivemind forwards them to both averagers.
- :mod:`.state_download`: a state download cut short passes for a whole one (then ``IndexError`` kills the
  receiver), metadata leaks from one peer to the next, served states can tear while the server steps or carry the
  next epoch's label on the parameters before its step, and nothing is validated, so a misfitting state makes a
  newcomer retry forever; and one failed hand-over of a snapshot (torch's shared memory) kills the donor's
  serving thread. Reproduced by ``tests/test_state_download.py``. Drop when hivemind validates downloads,
  reports cut streams and moves the epoch with its step (not in 1.1.12).
- :mod:`.stream_answers`: when a handler of a streamed request answers before reading it all (an averager refusing
  a tensor part), hivemind closes the stream with the caller's data unread, p2pd resets it and the answer is lost:
  the caller sees an empty stream or a broken pipe. Reproduced by ``tests/test_stream_answers.py`` (and, as a rare
  failure, by ``tests/test_auth_averaging.py``). The drain leaves a stream that hivemind's all-reduce task still
  reads to that task (``test_draining_a_request_stream_that_the_handler_still_reads_is_quiet``; seen as tracebacks
  in an 8-trainer swarm). Also, an averager shut down right after its round stopped its handler before the last
  answers had gone out, and a groupmate kept its own values there; the averager's shutdown now waits for its
  handlers (``tests/test_averagers.py``, case ``leave``; seen in CI as a pair whose final parameters differed).
  And a handler's end that closes first can reset the stream inside p2pd before the caller has read its answers
  (rare; CI: an empty refusal, a share one part short): the caller now closes first, once answered, and the handler
  waits for that (``test_the_caller_closes_an_answered_stream_first``). The same race cut served states at their
  tail (1 to 4 in 100 streams of 4 MB): a state's answers end with an empty message, at which its reader closes
  first (``test_a_served_state_arrives_whole_and_its_reader_closes_first``). Drop when hivemind reads a request to its
  end before closing, finishes its handlers before it shuts down and p2pd closes a stream without a reset.
- :mod:`.store_outcomes`: hivemind's progress tracker bounds each store of its record by a task whose outcome
  nobody reads, so a store that times out (a peer starved of CPU) logs an ERROR traceback; DiLoCo's outer averager
  did the same with hivemind's declaration loop, and now declares nothing. Reproduced by
  ``tests/test_state_declaration.py`` and ``tests/test_diloco.py`` (the catch-up case). Drop when hivemind reads
  its store tasks' outcomes.
- :mod:`.rpc_names`: hivemind names an averager's RPCs after its Python class, so a trainer with host gradients (a
  GPU) and one without (a CPU, or an aux peer assisting) never averaged gradients together. Reproduced by
  ``tests/test_averagers.py`` and ``tests/test_trainer_host_gradients.py``. Drop when hivemind names RPCs by protocol.
- :mod:`.control_pipe`: an averager's background process reads its control pipe non-blocking, so a large message
  whose sender pauses (a ``step`` whose ``gather`` carries DiLoCo's top-k payload, from a busy trainer) is lost
  half-read and its caller waits for its timeout. Reproduced by ``tests/test_control_pipe.py``. Drop when hivemind
  reads the pipe blocking (not in 1.1.12).
- :mod:`.dht_shutdown`: the DHT process closes its event loop with requests in flight, and one whose wake-up is
  queued then is destroyed half-way with an ERROR ("Task was destroyed but it is pending!"; CI: the 8-trainer
  swarm). Reproduced by ``tests/test_dht_shutdown.py``. Drop when hivemind's DHT finishes its tasks before closing
  its loop.
- :mod:`.dht_rejoin`: a DHT node drops a peer from its routing table after one unanswered request and re-adds
  peers only when they answer or call it, so a client-mode node (behind NAT) whose one entry peer missed a request
  is alone for good. Reproduced by ``tests/test_dht_rejoin.py``. Drop when hivemind refreshes an empty routing
  table from its initial peers.
- :mod:`.dht_pacing`: a matchmaking averager looks its group key up back to back for its whole window (366 lookups
  per second on loopback), and the progress tracker stores its record on every micro-batch; both keys live on the
  same few DHT nodes for the whole swarm. Here the lookups are paced to a few per window and the reports to one per
  0.5 s (longer in a swarm of more than 4), the latest; the tracker's lookups of the swarm's records (every 0.5 s
  near an epoch's end) come at most N/8 s apart in a swarm of N. Reproduced by ``tests/test_dht_pacing.py``. Drop
  when hivemind paces all three (not in its master).
- :mod:`.dht_beam`: every DHT search (a ``get``, the node search before each ``store``) asks the 20 nodes nearest
  its key, where the key lives on 5: in a swarm of up to ~20 every search asks every peer, so each peer's DHT
  serves one request per search of the whole swarm (16 trainers: 17 per second, 0.065 cores per peer in its DHT
  process and p2p daemon). Here a search asks 8 (more when it looks for more nodes). Reproduced by
  ``tests/test_dht_beam.py``. Drop when hivemind's default beam follows its replicas.
- :mod:`.record_checks`: a DHT node verifies every signed record of every answer it gets (an RSA check and a schema
  check each), also in the node searches of its stores, which discard the values, and gets the same records again
  and again: 36% of a DHT process's samples in a 6-trainer DiLoCo swarm. Here the verdict on an exact record is
  remembered. Reproduced by ``tests/test_record_checks.py``. Drop when hivemind remembers checked records.
- :mod:`.unary_calls`: a unary call cancelled while its answer arrives (a DHT request's timeout) makes the p2p
  client's one reader of the daemon's answers raise and stop, silently: the process then answers no DHT request and
  gets no answer (an aux peer that every trainer joined through went deaf as 16 trainers joined). Here an answer to
  a call that stopped waiting is dropped, and a reader that fails otherwise says so in one ERROR line. Reproduced by
  ``tests/test_unary_calls.py``. Drop when hivemind's reader skips answers to calls that are done.
- :mod:`.late_group`: a follower whose round reaches its deadline just as its leader's group arrives asserts in
  hivemind's matchmaking (an ERROR traceback; seen with 24 trainers on 2 cores). Here it declines that group, as one
  from a leader that disbanded. Reproduced by ``tests/test_late_group.py``. Drop when hivemind checks the group's
  future before it assembles.
- :mod:`.leader_resets`: a join request whose connection to the leader breaks (``ConnectionResetError``,
  ``BrokenPipeError``) ends the asking peer's whole matchmaking with an ERROR traceback, so it misses the round
  (seen with 16 DiLoCo trainers and churn). Here it is a leader that said no. Reproduced by
  ``tests/test_leader_resets.py``. Drop when hivemind's matchmaking catches ``ConnectionError``.
- :mod:`.declaration_stores`: an averager that matchmakes awaits the DHT store of its declaration before it sleeps
  until its declared time, so a leader closes its group only when both are past (stores returned up to 34 s late in
  a busy swarm over slow links), and one that leaves matchmaking (its group formed) awaits the store that withdraws
  it before its all-reduce begins (2-31 s; a group whose members began more than 20 s apart failed its round). Here
  both stores run in the background. Reproduced by ``tests/test_declaration_stores.py``. Drop when hivemind's
  matchmaking waits for neither store.
- :mod:`.shared_bytes`: hivemind's futures take their shared state byte from 16-byte buffers, each one a round
  trip to torch's shared-memory manager, which a peer starved of CPU misses (1 s), and the error ended a trainer's
  progress tracker. Here buffers hold a page and an unanswered allocation is tried again (bounded). Reproduced by
  ``tests/test_shared_bytes.py``. Drop when hivemind allocates its futures' state without torch's manager.
- :mod:`.step_cancel`: a round's ``StepControl`` cancelled twice (by the peer and by its averager's process at
  about the same time) raises ``InvalidStateError`` in hivemind's background thread, an ERROR traceback. Here a
  repeated cancel does nothing. Reproduced by ``tests/test_averagers.py``. Drop when hivemind's cancel is idempotent.
- :mod:`.progress_fetch`: the progress tracker holds its lock for the whole DHT lookup of the swarm's records, and
  every epoch end (and state download) takes that lock, so it waits for the lookup in flight: 4-12 s per epoch end
  with 16 DiLoCo trainers across emulated internet links. Here (DiLoCo's tracker) the lookup runs unlocked and a
  lookup begun before the epoch changed is not that epoch's fetch. Reproduced by ``tests/test_progress_fetch.py``.
  Drop when hivemind fetches outside its lock.
- Matchmaking deadlock (an option, in :func:`lean_transformer.swarm.averaging.optimizer.averager_options`): with hivemind's
  request timeout (3 s) at or above a short matchmaking window, two peers that wait for each other can miss every
  round; the timeout is kept to half the window. Covered by the swarm tests (``tests/test_trainer_swarm.py``).
  Drop when hivemind bounds its matchmaking requests by the window itself.
- Local updates with an offloaded optimizer (in DiLoCo mode's
  :meth:`lean_transformer.swarm.averaging.optimizer.SwarmOptimizer.step`): with ``use_local_updates=True`` hivemind
  never copies the model's gradients into its offloaded optimizer (it leaves that to a gradient averager, which this
  mode has none of), so every local step would apply zero gradients; the swarm optimizer copies them before each
  local step. Covered by ``tests/test_diloco_swarm.py`` (the loss falls). Drop when
  hivemind loads local gradients itself in that mode.
- Leaving during a round (in
  :meth:`lean_transformer.swarm.averaging.optimizer.SwarmOptimizer.cancel_rounds_in_flight`): hivemind's
  ``Optimizer.shutdown`` cancels the pre-scheduled round again and raises ``InvalidStateError`` if we cancelled it
  first; we forget it after cancelling. Covered by the SIGTERM tests (``tests/test_trainer_swarm.py``).
"""

from lean_transformer.swarm.hivemind_fixes import numpy_decode  # noqa: F401  (installs itself)
from lean_transformer.swarm.hivemind_fixes import (declaration_stores, dht_beam, dht_pacing, late_group,
                                                   leader_resets, quiet_logs, shared_bytes, step_cancel, unary_calls)

declaration_stores.install()
dht_beam.install()
dht_pacing.install()
late_group.install()
leader_resets.install()
quiet_logs.install()
shared_bytes.install()
step_cancel.install()
unary_calls.install()
