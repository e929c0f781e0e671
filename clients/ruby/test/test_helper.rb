# frozen_string_literal: true

# Real parts: Redis from dev/redis.sh, a real rebound-sidecar, real `sidekiq` processes.
# Environment: REBOUND_BIN_DIR  dir with rebound-sidecar and rebound-operator (default:
# `cargo build` them and use cargo's target dir). Logs under .state/rb-tests/run-PID/.
require "minitest/autorun"
require "json"
require "fileutils"
require "open3"
require "securerandom"
require "socket"
require "timeout"

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
      run!("cargo", "build", "--quiet", "--locked", "-p", "rebound-sidecar", "-p", "rebound-operator")
      File.join(JSON.parse(run!("cargo", "metadata", "--format-version", "1", "--no-deps"))["target_directory"], "debug")
    end
  end

  def redis_url
    @redis_url ||= begin
      dir = File.join(run_dir, "redis")
      Minitest.after_run { system(File.join(REPO, "dev", "redis.sh"), "down", dir, out: File::NULL, err: File::NULL) }
      last_line(run!(File.join(REPO, "dev", "redis.sh"), "up", dir))
    end
  end

  # The first Sidekiq client/API use in this process points it at the test Redis.
  def sidekiq_client
    @sidekiq_client ||= begin
      require "sidekiq"
      require "sidekiq/api"
      require "redis"
      Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=)
      url = redis_url
      Sidekiq.configure_client { |c| c.redis = {url: url} }
      Redis.new(url: url)
    end
  end

  def policies_file
    @policies_file ||= File.join(run_dir, "policies.yaml").tap { |p| File.write(p, File.read(File.join(HERE, "policies.yaml"))) }
  end

  def sidecar
    @sidecar ||= Sidecar.new(policies_file, "sidecar").tap(&:start)
  end

  # Processes this test process started, killed by PID at exit whatever happens.
  CHILDREN = {}
  at_exit do
    CHILDREN.each_key do |pid|
      Process.kill("KILL", pid)
    rescue StandardError
      nil
    end
  end

  def spawn_logged(env, cmd, log, pgroup: false)
    pid = Process.spawn(env, *cmd, in: File::NULL, out: [log, "a"], err: [log, "a"], chdir: REPO, pgroup: pgroup ? true : nil)
    CHILDREN[pid] = true
    pid
  end

  def reap(pid, timeout = 20)
    Timeout.timeout(timeout) { Process.wait(pid) }
  rescue Errno::ECHILD
    nil
  ensure
    CHILDREN.delete(pid)
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

# rebound-sidecar on a policies file (compiled locally), on a free port of 127.0.0.1.
class Sidecar
  attr_reader :target, :port

  def initialize(policies_file, name, probe_queue: "flaky")
    @probe_queue = probe_queue
    @port = Harness.free_port
    @target = "127.0.0.1:#{@port}"
    @log = File.join(Harness.run_dir, "#{name}.log")
    @cmd = [File.join(Harness.bin_dir, "rebound-sidecar"), "--policies-file", policies_file, "--namespace", "rbtest",
            "--listen", @target, "--no-admin"]
  end

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
    Process.kill("KILL", @pid) rescue nil
    Harness.reap(@pid)
    @pid = nil
  end
end

# `sidekiq -r test/app.rb` in its own process group (signalled as a group, by its PID).
class SidekiqWorker
  attr_reader :log, :pid

  # Each worker works only its own test's queues (several run at once on one Redis), and
  # the dead-letter queue (any of them records a dead letter in Redis).
  def initialize(target, name, queues:, concurrency: 2, env: {})
    @log = File.join(Harness.run_dir, "#{name}.log")
    @env = {"REDIS_URL" => Harness.redis_url, "REBOUND_TARGET" => target, "RUBYLIB" => LIB}.merge(env)
    @cmd = ["sidekiq", "-r", File.join(HERE, "app.rb"), "-c", concurrency.to_s, "-t", "3", "-v"] + (queues + ["work-dead"]).flat_map { |q| ["-q", q] }
  end

  def start
    @pid = Harness.spawn_logged(@env, @cmd, @log, pgroup: true)
    # Ready once its heartbeat names it in the processes set.
    Harness.sidekiq_client
    Harness.eventually("sidekiq #{@pid} running", 60) { Sidekiq::ProcessSet.new.any? { |p| p["pid"] == @pid } }
    self
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
  end

  def stop
    return unless @pid
    signal("TERM")
    begin
      Harness.reap(@pid, 20)
    rescue Timeout::Error
      kill
    end
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
