# frozen_string_literal: true

require "securerandom"
require "socket"
require "rebound/sidekiq"

module Rebound
  module Sidekiq
    # The failure of a run whose process stopped without finishing it (SIGKILL, OOM, node
    # loss), found by ReliableFetch: decided by the policy like any other failed run.
    class WorkerLost < StandardError; end

    # A fetch strategy for open-source Sidekiq that loses no job when a process is killed
    # (what Sidekiq Pro's super_fetch does): Rebound::Sidekiq.reliable_fetch!.
    #
    # A job is moved atomically (RPOPLPUSH) from its queue to a working list of this
    # process (rebound:working:IDENTITY|queue:NAME, listed in the set rebound:working-lists)
    # and removed from it when acknowledged.
    # Each process refreshes rebound:alive:IDENTITY every BEAT_S seconds (expiring after
    # ALIVE_TTL_S). Every process looks for working lists of processes that are no longer
    # alive every RECOVER_S seconds: each job there is a run that was lost; a Rebound job's
    # lost run counts as a failed run (error class Rebound::Sidekiq::WorkerLost) and is
    # decided by its policy (retry set, or the dead set and its dead letter); any other job
    # goes back onto its queue. A SIGTERM puts the unfinished jobs back, as Sidekiq does.
    # Queues are polled: a process with nothing to do asks again after IDLE_S.
    class ReliableFetch
      PREFIX = "rebound:working:"
      LISTS = "rebound:working-lists" # a set: every working list ever used
      ALIVE = "rebound:alive:"
      BEAT_S = 2
      ALIVE_TTL_S = 6
      RECOVER_S = 3
      IDLE_S = 0.2

      UnitOfWork = Struct.new(:queue, :job, :working) do
        def acknowledge
          ::Sidekiq.redis { |c| c.lrem(working, -1, job) }
        end

        def queue_name
          queue.delete_prefix("queue:")
        end

        def requeue
          ::Sidekiq.redis do |c|
            c.multi do |t|
              t.rpush(queue, job)
              t.lrem(working, -1, job)
            end
          end
        end
      end

      attr_reader :identity

      # options: Sidekiq 6's options hash, or a Sidekiq 7 capsule/config (queues, strict).
      def initialize(options)
        queues = options.respond_to?(:queues) ? options.queues : options[:queues]
        raise ArgumentError, "missing queue list" unless queues
        @strict = !!(options.respond_to?(:strict) ? options.strict : options[:strict])
        @queues = queues.map { |q| "queue:#{q}" }
        @queues.uniq! if @strict
        @identity = "#{Socket.gethostname}:#{Process.pid}:#{SecureRandom.hex(6)}"
        @lock = Mutex.new
        @thread = nil
        @registered = {}
      end

      def working_key(queue) = "#{PREFIX}#{@identity}|#{queue}"

      def retrieve_work
        start_keeper
        queues_cmd.each do |q|
          w = working_key(q)
          register(w)
          job = ::Sidekiq.redis { |c| c.rpoplpush(q, w) }
          return UnitOfWork.new(q, job, w) if job
        end
        sleep IDLE_S
        nil
      end

      # At shutdown: every unfinished job of this process back onto its queue.
      def bulk_requeue(_inprogress, _options = nil)
        n = 0
        ::Sidekiq.redis do |c|
          @queues.uniq.each do |q|
            w = working_key(q)
            n += 1 while c.rpoplpush(w, q)
          end
          c.del("#{ALIVE}#{@identity}") if @stopping
        end
        Rebound.log("info", "rebound.fetch_requeued", jobs: n) if n > 0
      rescue StandardError => e
        Rebound.log("warn", "rebound.fetch_requeue_failed", error: e.message.to_s[0, 300])
      end

      # Sidekiq 7 calls bulk_requeue(inprogress) only; 6.x bulk_requeue(inprogress, options).
      def queues_cmd
        return @queues if @strict
        @queues.shuffle.uniq
      end

      # Moves the jobs of processes no longer alive; returns how many.
      def recover
        found = 0
        ::Sidekiq.redis do |c|
          c.smembers(LISTS).each do |key|
            owner, queue = key.delete_prefix(PREFIX).split("|", 2)
            next if owner.nil? || queue.nil? || owner == @identity || c.exists?("#{ALIVE}#{owner}")
            mine = working_key(queue)
            register(mine)
            while (job = c.rpoplpush(key, mine)) # now in progress here: never lost, never doubled
              found += 1
              settle(c, job, queue, mine, owner)
            end
            c.srem(LISTS, key) if c.llen(key).zero?
          end
        end
        found
      end

      private

      def register(key)
        return if @registered[key]
        ::Sidekiq.redis { |c| c.sadd(LISTS, key) }
        @registered[key] = true
      end

      def start_keeper
        return if @thread&.alive?
        @lock.synchronize do
          return if @thread&.alive?
          @thread = Thread.new { keep }
        end
      end

      def keep
        last_recover = 0
        loop do
          begin
            ::Sidekiq.redis { |c| c.set("#{ALIVE}#{@identity}", "1", ex: ALIVE_TTL_S) }
            now = Process.clock_gettime(Process::CLOCK_MONOTONIC)
            if now - last_recover >= RECOVER_S
              last_recover = now
              recover
            end
          rescue StandardError => e
            Rebound.log("warn", "rebound.fetch_keeper_error", error: e.message.to_s[0, 300])
          end
          sleep BEAT_S
        end
      end

      # A recovered job: a Rebound job's lost run is a failed run decided by its policy;
      # any other job goes back onto its queue.
      def settle(conn, job, queue, mine, owner)
        msg = ::Sidekiq.load_json(job)
        klass = (Object.const_get(msg["class"].to_s) rescue nil)
        rebound = (klass && klass.include?(Rebound::Sidekiq::Worker)) || !Rebound::Sidekiq.active_job_class(msg).nil?
        Rebound.log("warn", "rebound.job_recovered", jid: msg["jid"], queue: queue.delete_prefix("queue:"), from: owner,
          decided: rebound)
        if rebound && msg["retry"]
          worker = (klass.new rescue nil)
          begin
            ServerMiddleware.new.send(:handle, worker, msg, queue.delete_prefix("queue:"),
              WorkerLost.new("the process #{owner} stopped while the job ran"))
          rescue ::Sidekiq::JobRetry::Skip
            conn.lrem(mine, -1, job)
            return
          end
        end
        conn.multi do |t|
          t.rpush(queue, job)
          t.lrem(mine, -1, job)
        end
      rescue StandardError => e
        Rebound.log("error", "rebound.recover_failed", error: e.inspect[0, 300])
        conn.multi do |t|
          t.rpush(queue, job)
          t.lrem(mine, -1, job)
        end
      end
    end

    class ReliableFetch
      # Rebound::Sidekiq.reliable_fetch!: ReliableFetch in this server process.
      def self.install
        ::Sidekiq.configure_server do |config|
          if ::Sidekiq.respond_to?(:options) && ::Sidekiq.options.is_a?(Hash) # 6.x: an instance
            fetch = ReliableFetch.new(::Sidekiq.options)
            ::Sidekiq.options[:fetch] = fetch
            config.on(:shutdown) { fetch.instance_variable_set(:@stopping, true) }
          else # 7.x: a class, made per capsule
            config[:fetch_class] = ReliableFetch
          end
        end
      end
    end
  end
end
