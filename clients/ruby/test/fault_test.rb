# frozen_string_literal: true

# clients/conformance/faults.json on real `sidekiq` processes with ReliableFetch, a Redis of
# each test's own (dev/redis.sh) and real rebound-sidecars on clients/conformance/policies.yaml.
# Faults are real: SIGSTOP/SIGCONT/SIGKILL of processes, a Redis ACL, maxmemory, a TCP proxy
# that drops one reply. Each scenario listing sidekiq has test_fault_<id, - as _>;
# test_every_fault_scenario_has_a_ruby_test fails when one has none. For every job the test
# tallies where it ended (Fault#tally) and asserts none is lost, runs <= maxAttempts +
# WINDOW, one dead letter per give-up.
require_relative "test_helper"
require "rebound/reliable_fetch"
require "uri"

module Fault
  module_function

  FAULTS = File.join(REPO, "clients", "conformance", "faults.json")
  POLICIES = File.join(REPO, "clients", "conformance", "policies.yaml")
  QUEUE = "fixed-3-dlq"
  DLQ = "fixed-3-dead"
  MAX_ATTEMPTS = 3
  # The documented at-least-once window (README, "Delivery"): duplicate runs per fault.
  WINDOW = 1
  RF = Rebound::Sidekiq::ReliableFetch
  # Longer than every liveness timeout: the alive TTL plus two recovery rounds.
  PAST_TIMEOUTS_S = RF::ALIVE_TTL_S + (2 * RF::RECOVER_S) + 2

  def scenarios = JSON.parse(File.read(FAULTS))["scenarios"].select { |s| s["libraries"].include?("sidekiq") }
  def scenario(id) = scenarios.find { |s| s["id"] == id } || raise("no fault scenario #{id} for sidekiq")

  def sidecar(name)
    Sidecar.new(POLICIES, name, probe_queue: "fixed-3", namespace: "conformance").start
  end

  def shared_sidecar
    @shared_sidecar ||= sidecar("fault/sidecar")
  end

  # A sidekiq process with ReliableFetch on the conformance jobs; runs are recorded in the
  # tests' Redis (REBOUND_RECORD_URL), the broker is the test's own.
  def worker(target, name, url, queues: [QUEUE], env: {}, concurrency: 2)
    SidekiqWorker.new(target, name, queues: queues, dead_letters: [], redis_url: url, concurrency: concurrency,
      env: {"REBOUND_RECORD_URL" => Harness.redis_url, "REBOUND_TEST_RELIABLE_FETCH" => "1"}.merge(env))
  end

  def jobs_loaded
    @jobs_loaded ||= begin
      Harness.sidekiq_client
      require_relative "jobs"
      true
    end
  end
end

# Forwards 127.0.0.1:port to a Redis; drops the reply to the first command whose bytes
# contain `marker` (after Redis applied it) by closing that connection.
class ReplyDropper
  attr_reader :port, :dropped

  def initialize(upstream_port, marker)
    @upstream = upstream_port
    @marker = marker
    @server = TCPServer.new("127.0.0.1", 0)
    @port = @server.addr[1]
    @dropped = 0
    @armed = true
    @threads = []
    @socks = []
    @lock = Mutex.new
  end

  def start
    @threads << Thread.new do
      loop do
        client = @server.accept
        upstream = TCPSocket.new("127.0.0.1", @upstream)
        @lock.synchronize { @socks.push(client, upstream) }
        pending = false
        @threads << Thread.new { pipe(client, upstream) { |data| pending = true if @armed && data.include?(@marker) } }
        @threads << Thread.new do
          pipe(upstream, client) do |_data|
            next true unless pending
            @lock.synchronize { @armed = false; @dropped += 1 }
            [client, upstream].each { |s| s.close rescue nil }
            false
          end
        end
      end
    rescue IOError, Errno::EBADF
      nil
    end
    self
  end

  def pipe(from, to)
    loop do
      data = from.readpartial(65_536)
      forward = yield(data)
      break if forward == false
      to.write(data)
    end
  rescue IOError, SystemCallError
    [from, to].each { |s| s.close rescue nil }
  end

  def stop
    @server.close rescue nil
    @lock.synchronize { @socks.each { |s| s.close rescue nil } }
    @threads.each { |t| t.kill }
  end
end

class FaultTest < Minitest::Test
  Job = Struct.new(:token, :jid)

  def setup
    Fault.jobs_loaded
  end

  def rec = Harness.sidekiq_client # the recording Redis

  # Pushed through the class, so the payload carries the class's options ("rebound").
  def enqueue(opts = {}, extra = {})
    token = SecureRandom.hex(8)
    jid = Sidekiq::Client.push({"class" => ConformJob, "queue" => Fault::QUEUE, "args" => [token, opts]}.merge(extra))
    Job.new(token, jid)
  end

  def runs(job) = rec.lrange("conf:runs:#{job.token}", 0, -1).map { |x| JSON.parse(x) }
  def done?(job) = rec.get("conf:done:#{job.token}")

  def letters(job)
    Sidekiq::Queue.new(Fault::DLQ).map(&:item).select { |i| i["args"].first.is_a?(Hash) && i["args"].first["jid"] == job.jid }.map { |i| i["args"].first }
  end

  def dead_entries(job) = Sidekiq::DeadSet.new.select { |e| e.jid == job.jid }

  # With a Redis of the test's own as the broker (the test process's client points there meanwhile).
  def with_broker(name)
    dir = File.join(Harness.run_dir, "fault-#{name}-redis")
    old = Sidekiq.redis_pool
    url = Harness.start_redis(dir)
    Sidekiq.redis = {url: url}
    yield url, Redis.new(url: url)
  ensure
    Sidekiq.redis = old if old
    Harness.stop_redis(dir) if dir
  end

  # Where each job ended: completed, retry (the retry set), queued, unacknowledged (a
  # working list), dead letter; lost = in none.
  def tally(jobs)
    working = Sidekiq.redis { |c| c.keys("#{Fault::RF::PREFIX}*").flat_map { |k| c.lrange(k, 0, -1) } }.map { |j| JSON.parse(j)["jid"] }
    retry_jids = Sidekiq::RetrySet.new.map(&:jid)
    queued = Sidekiq::Queue.new(Fault::QUEUE).map(&:jid)
    jobs.to_h do |j|
      place = if done?(j) then :completed
      elsif !letters(j).empty? then :dead_letter
      elsif retry_jids.include?(j.jid) then :retry
      elsif queued.include?(j.jid) then :queued
      elsif working.include?(j.jid) then :unacknowledged
      else :lost
      end
      [j.jid, place]
    end
  end

  # The expectations every scenario shares: none lost, runs within maxAttempts + WINDOW,
  # at most one dead letter per give-up (gave_up: how many give-ups each job had).
  def assert_fault_bounds(jobs, gave_up: 1)
    places = tally(jobs)
    assert_equal [], places.select { |_, p| p == :lost }.keys, "jobsLost"
    jobs.each do |j|
      assert_operator runs(j).length, :<=, (Fault::MAX_ATTEMPTS + Fault::WINDOW) * gave_up, "runsAtMost for #{j.jid}"
      assert_operator letters(j).length, :<=, gave_up, "deadLettersPerGiveUp for #{j.jid}"
      assert_operator dead_entries(j).length, :<=, 1, "one dead-set entry for #{j.jid}"
    end
    places
  end

  def events(workers, event, job = nil)
    workers.compact.flat_map { |w| w.events(event) }.select { |e| job.nil? || e["jid"] == job.jid }
  end

  # Restarts `make` whenever its process has died, until the block is true (bounded).
  def supervise(what, timeout, make)
    started = []
    w = make.call(0).start(wait: false)
    started << w
    Harness.eventually(what, timeout) do
      alive = (Process.kill(0, w.pid) && Process.waitpid(w.pid, Process::WNOHANG).nil? rescue false)
      unless alive
        Harness.reap(w.pid) rescue nil
        w = make.call(started.length).start(wait: false)
        started << w
      end
      yield
    end
    started
  ensure
    started&.each(&:stop)
  end

  def test_every_fault_scenario_has_a_ruby_test
    names = FaultTest.public_instance_methods.map(&:to_s)
    missing = Fault.scenarios.map { |s| s["id"] }.reject { |id| names.include?("test_fault_#{id.tr("-", "_")}") }
    assert_equal [], missing, "scenarios of clients/conformance/faults.json listing sidekiq without a Ruby test"
  end

  # Processes start while recovery runs every 2 ms: every job of a process SIGKILLed after
  # its start is still recovered (a list is never left where recovery cannot find it).
  def test_fault_registered_from_first_fetch
    Fault.scenario("registered-from-first-fetch")
    with_broker("registered") do |url|
      target = Fault.shared_sidecar.target
      stop = false
      recoverer = Fault::RF.new(queues: ["conf-none"])
      loop_thread = Thread.new { (recoverer.recover rescue nil; sleep 0.002) until stop }
      workers = Array.new(4) { |i| Fault.worker(target, "fault/registered-#{i}", url, concurrency: 1) }
      workers.each { |w| w.start(wait: false) }
      jobs = Array.new(4) { enqueue({"fail" => 0, "sleep_first" => 600}) }
      Harness.eventually("the 4 jobs running", 60) { jobs.all? { |j| runs(j).length == 1 } }
      stop = true
      loop_thread.join
      workers.each(&:kill)
      b = Fault.worker(target, "fault/registered-b", url, concurrency: 4).start
      Harness.eventually("every job completed", 90) { jobs.all? { |j| done?(j) } }
      assert_fault_bounds(jobs)
      assert_equal [2] * 4, jobs.map { |j| runs(j).length }
      assert_equal 4, events([b], "rebound.job_recovered").length
    ensure
      stop = true
      loop_thread&.join
      workers&.each(&:stop)
      b&.stop
    end
  end

  # SIGSTOP past every timeout while 4 jobs run (3 fail always; 1 on its last attempt
  # succeeds after SIGCONT); another process recovers meanwhile.
  def test_fault_paused_past_every_timeout
    want = Fault.scenario("paused-past-every-timeout")["expect"]
    with_broker("paused") do |url|
      target = Fault.shared_sidecar.target
      a = Fault.worker(target, "fault/paused-a", url, concurrency: 4).start
      failing = Array.new(3) { enqueue({"fail" => "always", "sleep_first" => 4}) }
      good = enqueue({"fail" => 0, "sleep_first" => 4}, {"retry_count" => 1, "failed_at" => Time.now.to_f})
      jobs = failing + [good]
      Harness.eventually("the 4 jobs running", 30) { jobs.all? { |j| runs(j).length == 1 } }
      a.signal("STOP")
      b = Fault.worker(target, "fault/paused-b", url, concurrency: 4).start
      sleep Fault::PAST_TIMEOUTS_S
      a.signal("CONT")
      Harness.eventually("every job ended", 90) { done?(good) && failing.all? { |j| !letters(j).empty? } }
      sleep Fault::RF::RECOVER_S + 1 # nothing more happens
      places = assert_fault_bounds(jobs)
      assert_equal :completed, places[good.jid]
      assert_equal [], letters(good), "completedNotDeadLettered"
      assert_equal [], dead_entries(good), "completedNotDeadLettered"
      assert_equal want["deadLettersPerGiveUp"], failing.map { |j| letters(j).length }.uniq.then { |x| x.length == 1 ? x.first : x }
    ensure
      a&.signal("CONT")
      [a, b].compact.each(&:stop)
    end
  end

  # Every run SIGKILLs its own process; a supervisor restarts it. Each lost run counts.
  def test_fault_killed_on_every_run
    want = Fault.scenario("killed-on-every-run")["expect"]
    with_broker("killed-every-run") do |url|
      target = Fault.shared_sidecar.target
      job = enqueue({"kill" => "always"})
      supervise("the dead letter", 150, ->(i) { Fault.worker(target, "fault/oom-#{i}", url) }) do
        !letters(job).empty? || runs(job).length > Fault::MAX_ATTEMPTS + Fault::WINDOW
      end
      assert_fault_bounds([job])
      (msg,) = letters(job)
      refute_nil msg, "finalState deadLetter"
      assert_equal runs(job).length, msg["attempts"] # deadLetterAttemptsEqualsRuns
      assert_equal [Fault::MAX_ATTEMPTS, "Rebound::Sidekiq::WorkerLost"], msg.values_at("attempts", "error_class")
      assert_equal 1, dead_entries(job).length
      assert want["everyUnansweredRunCounted"]
    end
  end

  # The sidecar hung and the process SIGKILLed while its hook waits for the answer.
  def test_fault_killed_while_deciding
    Fault.scenario("killed-while-deciding")
    with_broker("killed-deciding") do |url|
      sidecar = Fault.sidecar("fault/sidecar-hung-deciding")
      a = Fault.worker(sidecar.target, "fault/deciding-a", url, env: {"REBOUND_TEST_DEADLINE_MS" => "60000"}).start
      Harness.eventually("the policy fetched", 20) { a.events("rebound.policy_fetched").any? }
      Process.kill("STOP", -sidecar.pid)
      job = enqueue({"fail" => "always"})
      Harness.eventually("the first run", 30) { runs(job).length == 1 }
      sleep 1 # the hook waits for the hung sidecar
      a.kill
      Process.kill("CONT", -sidecar.pid)
      b = Fault.worker(sidecar.target, "fault/deciding-b", url).start
      Harness.eventually("the dead letter", 90) { !letters(job).empty? }
      assert_fault_bounds([job])
      assert_equal 3, runs(job).length
      decided = events([b], "rebound.retry", job).map { |e| e.values_at("attempt", "error_class") }
      assert_equal [[1, "Rebound::Sidekiq::WorkerLost"], [2, "TransientError"]], decided # everyUnansweredRunCounted
      assert_equal 3, letters(job).first["attempts"]
    ensure
      [a, b].compact.each(&:stop)
      sidecar&.kill
    end
  end

  # SIGKILL right after the give-up was written (a death handler kills the process).
  def test_fault_killed_between_dead_letter_and_ack
    want = Fault.scenario("killed-between-dead-letter-and-ack")["expect"]
    with_broker("killed-after-dead-letter") do |url|
      target = Fault.shared_sidecar.target
      a = Fault.worker(target, "fault/dl-ack-a", url, env: {"REBOUND_TEST_KILL_AFTER_GIVE_UP" => "1"}).start
      job = enqueue({"fail" => "always"}, {"retry_count" => 1, "failed_at" => Time.now.to_f}) # its last run
      Harness.eventually("the dead letter", 30) { !letters(job).empty? }
      a.wait_exit(20)
      b = Fault.worker(target, "fault/dl-ack-b", url).start
      sleep Fault::PAST_TIMEOUTS_S # past any recovery of a's lists
      assert_fault_bounds([job])
      assert_equal want["deadLetters"], letters(job).length
      assert_equal 1, runs(job).length
      assert_equal [], events([b], "rebound.job_recovered", job)
    ensure
      [a, b].compact.each(&:stop)
    end
  end

  # An ACL refuses the dead-letter queue's key during the last run, then allows it.
  def test_fault_dead_letter_write_refused
    want = Fault.scenario("dead-letter-write-refused")["expect"]
    with_broker("acl") do |url, admin|
      admin.call("ACL", "SETUSER", "worker", "on", ">pw", "+@all", "~*", "&*")
      wurl = url.sub("redis://", "redis://worker:pw@")
      target = Fault.shared_sidecar.target
      a = Fault.worker(target, "fault/acl", wurl).start
      admin.call("ACL", "SETUSER", "worker", "resetkeys", "~[^q]*", "~q[^u]*", "~queues", "~queue:#{Fault::QUEUE}")
      job = enqueue({"fail" => "always"}, {"retry_count" => 1, "failed_at" => Time.now.to_f})
      Harness.eventually("the last run", 30) { runs(job).length == 1 }
      sleep 4 # it has failed and its give-up is refused
      assert_equal [], letters(job) # neverCountedAsDeadLetteredWhileRefused
      assert_equal [], dead_entries(job)
      assert_equal [], events([a], "rebound.dead_lettered", job)
      assert_equal :unacknowledged, tally([job])[job.jid]
      admin.call("ACL", "SETUSER", "worker", "~*")
      Harness.eventually("the dead letter once allowed", 30) { !letters(job).empty? }
      assert_fault_bounds([job])
      assert_equal want["deadLettersAfterAllowed"], letters(job).length
      assert_equal 1, runs(job).length
      assert_equal 1, dead_entries(job).length
      assert_equal [], a.events("rebound.middleware_error") # never left to Sidekiq's own retries
    ensure
      a&.stop
    end
  end

  # Redis at maxmemory (noeviction) while 6 jobs give up, then memory freed.
  def test_fault_broker_out_of_memory
    Fault.scenario("broker-out-of-memory")
    with_broker("oom") do |url, admin|
      target = Fault.shared_sidecar.target
      a = Fault.worker(target, "fault/oom", url, concurrency: 6).start
      jobs = Array.new(6) { enqueue({"fail" => "always", "sleep" => 1.5}, {"retry_count" => 1, "failed_at" => Time.now.to_f}) }
      Harness.eventually("the jobs running", 30) { jobs.all? { |j| runs(j).length == 1 } }
      admin.call("CONFIG", "SET", "maxmemory-policy", "noeviction")
      admin.call("CONFIG", "SET", "maxmemory", "1")
      sleep 4 # the jobs fail and their give-ups are refused
      assert_equal [], jobs.flat_map { |j| letters(j) }
      admin.call("CONFIG", "SET", "maxmemory", "0")
      Harness.eventually("every dead letter", 60) { jobs.all? { |j| !letters(j).empty? } }
      sleep 1
      assert_fault_bounds(jobs)
      assert_equal [1] * 6, jobs.map { |j| letters(j).length }
      assert_equal [1] * 6, jobs.map { |j| runs(j).length }
    ensure
      admin&.call("CONFIG", "SET", "maxmemory", "0") rescue nil
      a&.stop
    end
  end

  # A proxy between the worker and Redis drops the reply to the give-up write.
  def test_fault_commit_reply_lost
    want = Fault.scenario("commit-reply-lost")["expect"]
    with_broker("reply-lost") do |url|
      proxy = ReplyDropper.new(URI(url).port, "queue:#{Fault::DLQ}").start
      target = Fault.shared_sidecar.target
      a = Fault.worker(target, "fault/reply-lost", "redis://127.0.0.1:#{proxy.port}/0").start
      job = enqueue({"fail" => "always"}, {"retry_count" => 1, "failed_at" => Time.now.to_f})
      Harness.eventually("the dead letter", 30) { !letters(job).empty? }
      sleep 2
      assert_equal 1, proxy.dropped
      assert_fault_bounds([job])
      assert_equal want["deadLetters"], letters(job).length
      assert_equal 1, dead_entries(job).length
      assert_equal 1, runs(job).length
    ensure
      a&.stop
      proxy&.stop
    end
  end

  # 80 running jobs lost with their process, recovered by two processes while the sidecar
  # is SIGSTOPped for 20 s: each ends with one dead letter.
  def test_fault_sidecar_hung
    want = Fault.scenario("sidecar-hung")["expect"]
    with_broker("sidecar-hung") do |url|
      sidecar = Fault.sidecar("fault/sidecar-hung")
      a = Fault.worker(sidecar.target, "fault/hung-a", url, concurrency: 80).start
      jobs = Array.new(80) { enqueue({"fail" => "always", "sleep_first" => 600}) }
      Harness.eventually("the 80 jobs running", 60) { jobs.all? { |j| runs(j).length == 1 } }
      # b and c connected to the sidecar before it hangs: their calls wait for the deadline.
      b = Fault.worker(sidecar.target, "fault/hung-b", url, concurrency: 5).start
      c = Fault.worker(sidecar.target, "fault/hung-c", url, concurrency: 5).start
      Harness.eventually("b and c on the sidecar", 20) { [b, c].all? { |w| w.events("rebound.policy_fetched").any? } }
      a.kill
      Process.kill("STOP", -sidecar.pid)
      hung_at = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      sleep [20 - (Process.clock_gettime(Process::CLOCK_MONOTONIC) - hung_at), 0].max
      Process.kill("CONT", -sidecar.pid)
      Harness.eventually("every dead letter", 120) { jobs.all? { |j| !letters(j).empty? } }
      sleep Fault::RF::RECOVER_S + 1
      assert_fault_bounds(jobs)
      assert_equal [1], jobs.map { |j| letters(j).length }.uniq
      assert_equal [3], jobs.map { |j| runs(j).length }.uniq
      assert_includes events([b, c], "rebound.retry").map { |e| e["source"] }, want["source"]
    ensure
      sidecar && (Process.kill("CONT", -sidecar.pid) rescue nil)
      [a, b, c].compact.each(&:stop)
      sidecar&.kill
    end
  end

  # Given up after its runs were killed, then replayed with Rebound::Sidekiq.replay.
  def test_fault_replay_after_crashes
    want = Fault.scenario("replay-after-crashes")["expect"]
    with_broker("replay-crashes") do |url|
      target = Fault.shared_sidecar.target
      job = enqueue({"kill" => 3})
      supervise("the dead letter", 150, ->(i) { Fault.worker(target, "fault/replay-#{i}", url) }) do
        !letters(job).empty? || runs(job).length > Fault::MAX_ATTEMPTS + Fault::WINDOW
      end
      (msg,) = letters(job)
      refute_nil msg
      w = Fault.worker(target, "fault/replay-run", url).start
      assert_equal job.jid, Rebound::Sidekiq.replay(msg) # the README's command
      Harness.eventually("the replayed run", 60) { done?(job) }
      assert_equal Fault::MAX_ATTEMPTS + want["replayRuns"], runs(job).length
      assert_equal [job.jid], runs(job).map { |r| r["jobId"] }.uniq # sameJobId
      assert_fault_bounds([job])
      assert_equal 1, letters(job).length
    ensure
      w&.stop
    end
  end

  # Gives up, is retried from the dead set and gives up again: two dead letters.
  def test_fault_gives_up_twice
    want = Fault.scenario("gives-up-twice")["expect"]
    with_broker("twice") do |url|
      a = Fault.worker(Fault.shared_sidecar.target, "fault/twice", url).start
      job = enqueue({"fail" => "always"})
      Harness.eventually("the first dead letter", 60) { letters(job).length == 1 }
      Harness.eventually("the dead set entry", 10) { dead_entries(job).length == 1 }
      Rebound::Sidekiq.replay(job.jid)
      Harness.eventually("the second dead letter", 60) { letters(job).length == 2 }
      sleep 1
      assert_fault_bounds([job], gave_up: 2)
      assert_equal want["deadLetters"], letters(job).length
      assert_equal [3, 4], letters(job).map { |l| l["attempts"] }.sort
      assert_equal 4, runs(job).length
    ensure
      a&.stop
    end
  end

  # 40 jobs on their last attempt lost with their process; the process recovering them
  # (slowly: the sidecar hung) is SIGKILLed mid-recovery; a third one finishes.
  def test_fault_killed_during_recovery
    want = Fault.scenario("killed-during-recovery")["expect"]
    with_broker("killed-recovering") do |url|
      sidecar = Fault.sidecar("fault/sidecar-recovering")
      a = Fault.worker(sidecar.target, "fault/recovering-a", url, concurrency: 40).start
      # b works another queue; it is on the sidecar before it hangs, so each decision of its
      # recovery waits for the deadline, and the kill lands between a claim and its settle.
      b = Fault.worker(sidecar.target, "fault/recovering-b", url, queues: ["fixed-3"]).start
      Harness.eventually("b on the sidecar", 20) { b.events("rebound.policy_fetched").any? }
      jobs = Array.new(40) { enqueue({"fail" => 0, "sleep_first" => 600}, {"retry_count" => 1, "failed_at" => Time.now.to_f}) }
      Harness.eventually("the 40 jobs running", 60) { jobs.all? { |j| runs(j).length == 1 } }
      a.kill
      Process.kill("STOP", -sidecar.pid)
      Harness.eventually("b recovering", 60) { b.events("rebound.job_recovered").length >= 3 }
      b.kill
      Process.kill("CONT", -sidecar.pid)
      c = Fault.worker(sidecar.target, "fault/recovering-c", url, queues: ["fixed-3"]).start
      Harness.eventually("every dead letter", 90) { jobs.all? { |j| !letters(j).empty? } }
      sleep Fault::RF::RECOVER_S + 1
      assert_fault_bounds(jobs)
      assert_equal [want["deadLetters"]], jobs.map { |j| letters(j).length }.uniq
      assert_equal [1], jobs.map { |j| dead_entries(j).length }.uniq
      assert_equal [Fault::MAX_ATTEMPTS], jobs.map { |j| letters(j).first["attempts"] }.uniq
      owners = events([b], "rebound.job_recovered").map { |e| e["from"] }.uniq # a's identity
      from_b = events([c], "rebound.job_recovered").reject { |e| owners.include?(e["from"]) }
      refute_empty from_b, "a job b claimed and did not settle, settled by c"
      assert_equal [Fault::MAX_ATTEMPTS], from_b.map { |e| e["attempt"] }.uniq # not counted again
    ensure
      sidecar && (Process.kill("CONT", -sidecar.pid) rescue nil)
      [a, b, c].compact.each(&:stop)
      sidecar&.kill
    end
  end

  # Every run kills its process; the lost runs are recovered by a process without the job's
  # class (it works another queue): they still count, and the job ends in the dead letter.
  def test_fault_recovered_without_job_class
    want = Fault.scenario("recovered-without-job-class")["expect"]
    with_broker("no-class") do |url|
      target = Fault.shared_sidecar.target
      b = Fault.worker(target, "fault/no-class", url, queues: ["conf-other"], env: {"REBOUND_TEST_NO_JOBS" => "1"}).start
      job = enqueue({"kill" => "always"})
      runners = []
      # Each run's process dies before the next starts: only b (no class) can recover.
      (1..Fault::MAX_ATTEMPTS + Fault::WINDOW).each do |run|
        break unless letters(job).empty?
        runners << Fault.worker(target, "fault/no-class-run-#{run}", url).start(wait: false)
        Harness.eventually("run #{run}", 60) { runs(job).length >= run }
        runners.last.wait_exit(30)
        Harness.eventually("run #{run} recovered by b", 60) { events([b], "rebound.job_recovered", job).length >= run }
      end
      assert_fault_bounds([job])
      assert want["everyUnansweredRunCounted"]
      (msg,) = letters(job)
      refute_nil msg, "endsWithin"
      assert_equal [Fault::MAX_ATTEMPTS, Fault::MAX_ATTEMPTS], [msg["attempts"], runs(job).length]
      recovered = events([b], "rebound.job_recovered", job)
      assert_equal [false], recovered.map { |e| e["job_class_loaded"] }.uniq
    ensure
      runners&.each(&:stop)
      b&.stop
    end
  end
end
