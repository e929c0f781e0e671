# frozen_string_literal: true

require "grpc"
require "rebound/v1/advisor_services_pb"

module Rebound
  # The gRPC client of rebound.v1.RetryAdvisor: one channel per process, made on first use.
  #
  # A gRPC channel must not cross fork, so the stub is remembered with the PID that made it
  # and a new one is made in a forked child (the parent's is abandoned, never used there).
  # Ruby gRPC stubs are safe to share between threads.
  class Client
    TARGET_RE = /\A(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):\d{1,5}\z/.freeze
    CHANNEL_ARGS = {
      "grpc.initial_reconnect_backoff_ms" => 100,
      "grpc.max_reconnect_backoff_ms" => 1000,
      "grpc.enable_retries" => 0,
      "grpc.keepalive_time_ms" => 30_000,
    }.freeze

    attr_reader :target, :deadline_s

    # Accepts "unix:///abs/path.sock", "unix:/abs/path" and "host:port".
    def self.check_target(target)
      unless target.is_a?(String) && (target.start_with?("unix:") || TARGET_RE.match?(target))
        raise ArgumentError, "target: #{target.inspect} is not \"unix:///path/to.sock\" or \"127.0.0.1:PORT\""
      end
      target
    end

    def initialize(target, deadline_s)
      @target = self.class.check_target(target)
      @deadline_s = deadline_s
      @lock = Mutex.new
      @pid = nil
      @stub = nil
    end

    def decide(request)
      stub.decide(request, deadline: Time.now + @deadline_s)
    end

    def get_policy(queue)
      stub.get_policy(V1::GetPolicyRequest.new(queue: queue), deadline: Time.now + @deadline_s)
    end

    def close
      @lock.synchronize do
        @stub&.instance_variable_get(:@ch)&.close if @pid == Process.pid
        @stub = nil
      end
    rescue StandardError
      nil
    end

    private

    def stub
      @lock.synchronize do
        if @stub.nil? || @pid != Process.pid
          @stub = V1::RetryAdvisor::Stub.new(@target, :this_channel_is_insecure, channel_args: CHANNEL_ARGS)
          @pid = Process.pid
        end
        @stub
      end
    end
  end
end
