//! What a training or evaluation step reports, and the metrics burn-train shows of it:
//! the forward time per batch and the phone error rate.

use super::*;

/// What a training or evaluation step reports.
#[derive(Debug)]
pub struct CtcOutput {
    /// Mean over the batch of the CTC loss per target phone, `[1]`.
    pub loss: Tensor<1>,
    /// Edit distance and reference phones of the batch (zero in training steps).
    pub per: PhoneErrorRate,
    /// Wall-clock time of the batch's forward pass, in milliseconds.
    pub forward_ms: f64,
}

/// The forward time of a batch in milliseconds, the input of [`ForwardTimeMetric`].
#[derive(Debug, Clone, Copy)]
pub struct ForwardTime(pub f64);

impl ItemLazy for CtcOutput {
    /// Moves the loss off the training device, onto Flex, for the metrics.
    fn sync(self) -> Result<Self, ExecutionError> {
        Ok(CtcOutput {
            loss: Tensor::from_data(self.loss.try_into_data()?, &Device::flex()),
            per: self.per,
            forward_ms: self.forward_ms,
        })
    }
}

impl Adaptor<LossInput> for CtcOutput {
    fn adapt(&self) -> LossInput {
        LossInput::new(self.loss.clone())
    }
}

impl Adaptor<PhoneErrorRate> for CtcOutput {
    fn adapt(&self) -> PhoneErrorRate {
        self.per
    }
}

impl Adaptor<ForwardTime> for CtcOutput {
    fn adapt(&self) -> ForwardTime {
        ForwardTime(self.forward_ms)
    }
}

/// The wall-clock time of a training batch's forward pass, in milliseconds, as a burn-train
/// metric ([`FORWARD_METRIC`]); [`EpochClock`] keeps its mean per epoch. The step waits for
/// the device after the forward pass to time it (`Device::sync`): nothing on the CPU
/// backends, one synchronisation per step on the GPU ones.
#[derive(Clone)]
pub struct ForwardTimeMetric {
    name: MetricName,
    state: NumericMetricState,
}

impl Default for ForwardTimeMetric {
    fn default() -> Self {
        Self {
            name: Arc::new(FORWARD_METRIC.to_string()),
            state: NumericMetricState::new(),
        }
    }
}

impl Metric for ForwardTimeMetric {
    type Input = ForwardTime;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: Some("ms".into()),
            higher_is_better: false,
        }
        .into()
    }

    fn update(
        &mut self,
        item: &ForwardTime,
        _metadata: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        self.state.update(item.0, 1);
        Ok(self.state.compute_update(self.format()))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self.state.compute_final(self.format()))
    }

    fn clear(&mut self) {
        self.state.reset()
    }
}

impl ForwardTimeMetric {
    fn format(&self) -> FormatOptions {
        FormatOptions::new(self.name()).unit("ms").precision(0)
    }
}

impl Numeric for ForwardTimeMetric {
    fn value(&self) -> Option<NumericEntry> {
        Some(self.state.current_value())
    }

    fn running_value(&self) -> Option<NumericEntry> {
        Some(self.state.running_value())
    }

    fn final_value(&self) -> NumericEntry {
        self.state.final_value()
    }
}

/// The phone error rate as a burn-train metric: Σ edit distance / Σ reference phones over
/// the epoch, in percent.
#[derive(Clone)]
pub struct PhoneErrorRateMetric {
    name: MetricName,
    state: NumericMetricState,
}

impl Default for PhoneErrorRateMetric {
    fn default() -> Self {
        Self {
            name: Arc::new("PER".to_string()),
            state: NumericMetricState::new(),
        }
    }
}

impl Metric for PhoneErrorRateMetric {
    type Input = PhoneErrorRate;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: Some("%".into()),
            higher_is_better: false,
        }
        .into()
    }

    fn update(
        &mut self,
        item: &PhoneErrorRate,
        _metadata: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        self.state
            .update(item.percent(), item.reference_phones.max(1));
        Ok(self.state.compute_update(self.format()))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self.state.compute_final(self.format()))
    }

    fn clear(&mut self) {
        self.state.reset()
    }
}

impl PhoneErrorRateMetric {
    fn format(&self) -> FormatOptions {
        FormatOptions::new(self.name()).unit("%").precision(2)
    }
}

impl Numeric for PhoneErrorRateMetric {
    fn value(&self) -> Option<NumericEntry> {
        Some(self.state.current_value())
    }

    fn running_value(&self) -> Option<NumericEntry> {
        Some(self.state.running_value())
    }

    fn final_value(&self) -> NumericEntry {
        self.state.final_value()
    }
}
