# frozen_string_literal: true

# Real parts: Redis from dev/redis.sh, a real rebound-sidecar, real `sidekiq` processes.
# Environment: REBOUND_BIN_DIR  dir with rebound-sidecar and rebound-operator (default:
# `cargo build` them and use cargo's target dir, CARGO_TARGET_DIR if set). Logs under
# .state/rb-tests/run-PID/. Every process started here is stopped after the run, on
# failure too (Harness.stop_all; test/watchdog.rb if this process is killed).
require "minitest/autorun"
require "json"
require "fileutils"
require "open3"
require "securerandom"
require "socket"
require "timeout"
require "monitor"

REPO = File.expand_path("../../..", __dir__)
HERE = __dir__
LIB = File.expand_path("../lib", __dir__)
$LOAD_PATH.unshift(LIB)

module Harness
  module_function

  def run!(*cmd, env: {}, input: nil)
    out, err, st = Open3.capture3(env, *cmd, stdin_data: input.to_s, chdir: REPO)
    raise "#{cmd.join(" ")} failed (#{st.exitstatus}):\n#{out}\n#{err}" unless st.success?
    out
  end

  def last_line(text) = text.strip.split("\n").last.to_s.strip

  def free_port
    s = TCPServer.new("127.0.0.1", 0)
    s.addr[1]
  ensure
    s&.close
  end

  def eventually(what, timeout = 30)
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
    loop do
      v = yield
      return v if v
      raise Minitest::Assertion, "timed out after #{timeout}s waiting for #{what}" if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
      sleep 0.1
    end
  end

  def run_dir
    @run_dir ||= File.join(REPO, ".state", "rb-tests", "run-#{Process.pid}").tap do |d|
      FileUtils.mkdir_p(d)
      require "rebound/advisor"
      Rebound.log_io = File.open(File.join(d, "test-process.log"), "a").tap { |f| f.sync = true }
    end
  end

  def bin_dir
    @bin_dir ||= ENV["REBOUND_BIN_DIR"] || begin
      # cargo honours CARGO_TARGET_DIR (dev/test.sh, the shared /work/target-adapters): so does this.
      run!("cargo", "build", "--quiet", "--locked", "-p", "rebound-sidecar", "-p", "rebound-operator")
      File.join(ENV["CARGO_TARGET_DIR"].to_s.empty? ? JSON.parse(run!("cargo", "metadata", "--format-version", "1", "--no-deps"))["target_directory"] : File.expand_path(ENV["CARGO_TARGET_DIR"], REPO), "debug")
    end
  end

  def redis_url
    @redis_url ||= start_redis(File.join(run_dir, "redis"))
  end

  # A Redis of its own (dev/redis.sh) in dir, stopped after the run (and by the watchdog).
  def start_redis(dir, persist: false)
    track_redis(dir)
    last_line(run!(File.join(REPO, "dev", "redis.sh"), "up", dir, *(persist ? ["--persist"] : []), env: test_env))
  end

  def stop_redis(dir)
    system(File.join(REPO, "dev", "redis.sh"), "down", dir, out: File::NULL, err: File::NULL)
    LOCK.synchronize { REDISES.delete(dir) }
    write_registry
  end

  # Stops a Redis by its PID, keeping its data (start_redis again restarts it on its port).
  def stop_redis_keeping_data(dir)
    pid = File.read(File.join(dir, "redis.pid")).to_i
    Process.kill("TERM", pid)
    eventually("redis #{pid} stopped", 20) { !(Process.kill(0, pid) rescue false) }
  end

  # The first Sidekiq client/API use in this process points it at the test Redis.
  def sidekiq_client
    @sidekiq_client ||= begin
      require "sidekiq"
      require "sidekiq/api"
      require "redis"
      Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=)
      url = redis_url
      ENV["REDIS_URL"] = url
      Sidekiq.configure_client { |c| c.redis = {url: url} }
      Redis.new(url: url)
    end
  end

  def policies_file
    @policies_file ||= File.join(run_dir, "policies.yaml").tap { |p| File.write(p, File.read(File.join(HERE, "policies.yaml"))) }
  end

  def sidecar
    @sidecar ||= Sidecar.new(policies_file, "sidecar").start
  end

  # What every process a test starts carries, so that a check can find any left behind
  # (rake test's leftovers task; test/cleanup_test.rb), besides its working directory.
  def test_env
    {"REBOUND_TEST_RUN" => run_dir}
  end

  # Processes (process groups) and Redis servers this test process started. They are
  # stopped after the run (Minitest.after_run, also on failures and interrupts) and, if
  # this process dies without running it (SIGKILL), by test/watchdog.rb, which watches
  # this PID and reads the same list from run_dir/children.
  CHILDREN = {}
  REDISES = {}
  LOCK = Monitor.new

  def registry_file = File.join(run_dir, "children")

  def write_registry
    LOCK.synchronize do
      lines = CHILDREN.keys.map { |pid| "pgroup #{pid}" } + REDISES.keys.map { |d| "redis #{d}" }
      File.write("#{registry_file}.tmp", lines.join("\n") + "\n")
      File.rename("#{registry_file}.tmp", registry_file)
    end
  end

  def watchdog
    @watchdog ||= begin
      pid = Process.spawn("ruby", File.join(HERE, "watchdog.rb"), Process.pid.to_s, registry_file, REPO,
        in: File::NULL, out: [File.join(run_dir, "watchdog.log"), "a"], err: [File.join(run_dir, "watchdog.log"), "a"], pgroup: true)
      Process.detach(pid)
      Minitest.after_run { Harness.stop_all }
      pid
    end
  end

  def track_redis(dir)
    watchdog
    LOCK.synchronize { REDISES[dir] = true }
    write_registry
  end

  # Every child in its own process group (its own children go with it).
  # Each runs in run_dir (or a directory under it): that is how the leftovers check finds it.
  def spawn_logged(env, cmd, log, chdir: run_dir)
    watchdog
    pid = Process.spawn(test_env.merge(env), *cmd, in: File::NULL, out: [log, "a"], err: [log, "a"], chdir: chdir, pgroup: true)
    LOCK.synchronize { CHILDREN[pid] = true }
    write_registry
    pid
  end

  def reap(pid, timeout = 20)
    Timeout.timeout(timeout) { Process.wait(pid) }
  rescue Errno::ECHILD
    nil
  ensure
    LOCK.synchronize { CHILDREN.delete(pid) }
    write_registry
  end

  # Stops everything still running: process groups (TERM, then KILL), then the Redis servers.
  def stop_all
    pids = LOCK.synchronize { CHILDREN.keys }
    pids.each { |pid| Process.kill("TERM", -pid) rescue nil }
    pids.each do |pid|
      begin
        Timeout.timeout(10) { Process.wait(pid) }
      rescue Timeout::Error, Errno::ECHILD
        nil
      end
      Process.kill("KILL", -pid) rescue nil
      Process.wait(pid) rescue nil
      LOCK.synchronize { CHILDREN.delete(pid) }
    end
    LOCK.synchronize { REDISES.keys }.each do |dir|
      system(File.join(REPO, "dev", "redis.sh"), "down", dir, out: File::NULL, err: File::NULL)
      LOCK.synchronize { REDISES.delete(dir) }
    end
    write_registry
  end

  # JSON lines in a log (the adapter's events start with {"time").
  def events(path, event = nil)
    return [] unless File.exist?(path)
    events_in(File.read(path, mode: "rb"), event)
  end

  def events_in(text, event = nil)
    text.dup.force_encoding("UTF-8").scrub.each_line.filter_map do |line|
      at = line.index('{"time"')
      next unless at
      doc = JSON.parse(line[at..]) rescue nil
      doc if doc.is_a?(Hash) && (event.nil? || doc["event"] == event)
    end
  end
end

# rebound-sidecar on a policies file (compiled locally), on a free (or given) port of 127.0.0.1.
class Sidecar
  attr_reader :target, :port, :log

  # RetryPolicy YAML compiled locally, or with policies_dir a compiled document
  # (policies.json in that directory) served as the operator wrote it.
  def initialize(policies_file, name, probe_queue: "flaky", namespace: "rbtest", port: nil, policies_dir: nil)
    @probe_queue = probe_queue
    @port = port || Harness.free_port
    @target = "127.0.0.1:#{@port}"
    @log = File.join(Harness.run_dir, "#{name}.log")
    FileUtils.mkdir_p(File.dirname(@log))
    source = policies_dir ? ["--policies-dir", policies_dir] : ["--policies-file", policies_file]
    @cmd = [File.join(Harness.bin_dir, "rebound-sidecar"), *source, "--namespace", namespace,
            "--listen", @target, "--no-admin"]
  end

  def pid = @pid

  def start
    @pid = Harness.spawn_logged({}, @cmd, @log)
    Harness.eventually("the sidecar listening", 20) { (TCPSocket.new("127.0.0.1", @port).close || true) rescue false }
    require "rebound/advisor"
    probe = Rebound::Advisor.new(target: @target, deadline_ms: 1000)
    Harness.eventually("the sidecar serving", 20) { probe.client.get_policy(@probe_queue) rescue false }
    probe.client.close
    self
  end

  def kill
    return unless @pid
    Process.kill("KILL", -@pid) rescue nil
    Harness.reap(@pid)
    @pid = nil
  end
end

# `sidekiq -r test/app.rb` in its own process group (signalled as a group, by its PID).
class SidekiqWorker
  attr_reader :log, :pid

  # Each worker works only its own test's queues (several run at once on one Redis), and
  # the dead-letter queue (any of them records a dead letter in Redis).
  def initialize(target, name, queues:, concurrency: 2, env: {}, dead_letters: ["work-dead"], redis_url: nil)
    @log = File.join(Harness.run_dir, "#{name}.log")
    FileUtils.mkdir_p(File.dirname(@log))
    @env = {"REDIS_URL" => redis_url || Harness.redis_url, "REBOUND_TARGET" => target, "RUBYLIB" => LIB}.merge(env)
    @cmd = ["sidekiq", "-r", File.join(HERE, "app.rb"), "-c", concurrency.to_s, "-t", "3", "-v"] + (queues + dead_letters).flat_map { |q| ["-q", q] }
  end

  # Started and (wait) registered in Sidekiq's process set.
  def start(wait: true)
    @pid = Harness.spawn_logged(@env, @cmd, @log)
    return self unless wait
    Harness.sidekiq_client
    Harness.eventually("sidekiq #{@pid} running", 60) { Sidekiq::ProcessSet.new.any? { |p| p["pid"] == @pid } }
    self
  end

  # The exit status of a worker expected to stop by itself.
  def wait_exit(timeout = 60)
    st = nil
    Timeout.timeout(timeout) { _, st = Process.wait2(@pid) }
    Harness::LOCK.synchronize { Harness::CHILDREN.delete(@pid) }
    Harness.write_registry
    Process.kill("KILL", -@pid) rescue nil
    @pid = nil
    st
  end

  def events(event = nil) = Harness.events(@log, event)

  def signal(sig)
    Process.kill(sig, -@pid)
  rescue Errno::ESRCH
    nil
  end

  def kill
    signal("KILL")
    Harness.reap(@pid)
    @pid = nil
  end

  def stop
    return unless @pid
    signal("TERM")
    begin
      Harness.reap(@pid, 20)
    rescue Timeout::Error
      kill
    end
    signal("KILL") if @pid # whatever it started
    @pid = nil
  end
end

# One shared worker for the tests that need no special one; stopped at exit.
module Shared
  module_function

  def worker
    @worker ||= SidekiqWorker.new(Harness.sidecar.target, "worker", queues: %w[flaky doomed dropme payments deadline]).start.tap { |w| Minitest.after_run { w.stop } }
  end
end
